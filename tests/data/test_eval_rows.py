"""Evaluation rows: the prompt of a one-row batch is every real token before the first supervised one."""

from __future__ import annotations

import pytest
import torch
from utils import text_batch

from dflash_hf.data.eval_rows import prompt_inputs
from dflash_hf.testing import tiny


def test_prompt_inputs_cut_before_first_supervised_token():
    tok = tiny.build_tokenizer()
    rows = [([5, 6, 7], [8, 9]), ([1, 2, 3, 4, 5, 6], [7])]
    batch = text_batch(rows, tok.pad_token_id, "left")
    first = prompt_inputs({k: v[:1] for k, v in batch.items()})
    assert first["input_ids"].tolist() == [[5, 6, 7]] and first["attention_mask"].tolist() == [[1, 1, 1]]
    assert "loss_mask" not in first
    no_sup = {k: v[:1] for k, v in batch.items()}
    no_sup["loss_mask"] = torch.zeros_like(no_sup["loss_mask"])
    assert prompt_inputs(no_sup) is None
    with pytest.raises(ValueError, match="one-row"):
        prompt_inputs(batch)
