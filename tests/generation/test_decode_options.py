"""`DecodeOptions`: one object for how a decode runs, also taken as keywords by the public decoding functions."""

from __future__ import annotations

import pytest
import torch
from utils import tiny_text_target

from dflash_hf import DFlashConfig, DFlashDraftModel
from dflash_hf.generation import DecodeOptions, decode_benchmark


def test_the_step_modes_are_keywords_or_options_never_both():
    assert DecodeOptions.of(None, False, True, 8) == DecodeOptions(False, True, 8)
    assert DecodeOptions.of(DecodeOptions(verify_cuda_graph=False)) == DecodeOptions(None, False, None)
    with pytest.raises(ValueError, match="draft_cuda_graph given beside options"):
        DecodeOptions.of(DecodeOptions(), draft_cuda_graph=False)
    with pytest.raises(ValueError, match="verify_cuda_graph must be None .*, True or False, got 'auto'"):
        DecodeOptions(verify_cuda_graph="auto")


def test_decode_benchmark_takes_the_step_modes_as_keywords_as_speculative_generate_does():
    model, tok = tiny_text_target(num_layers=2)
    cfg = DFlashConfig.from_target_config(model.config, mask_token_id=262, num_hidden_layers=1, block_size=4)
    torch.manual_seed(0)
    draft = DFlashDraftModel(cfg).eval()
    prompts = [{"input_ids": torch.tensor([[1, 7, 9, 11]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}]
    by_keywords = decode_benchmark(draft, model, prompts, 6, warmup=False, draft_cuda_graph=False)
    by_options = decode_benchmark(draft, model, prompts, 6, warmup=False, options=DecodeOptions(False))
    assert by_keywords.acceptance_lengths == by_options.acceptance_lengths and not by_keywords.mismatches
    assert by_keywords.draft_steps == by_options.draft_steps == {"eager": 1}
    with pytest.raises(ValueError, match="verify_cuda_graph given beside options"):
        decode_benchmark(draft, model, prompts, 6, options=DecodeOptions(), verify_cuda_graph=False)
