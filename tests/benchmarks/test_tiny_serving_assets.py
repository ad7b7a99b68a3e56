"""benchmarks/tiny_serving_assets.py: the target, both drafts and the prompts it writes load and decode together."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import tiny_serving_assets  # noqa: E402

from dflash_hf import load_draft_strict, load_target, speculative_generate  # noqa: E402
from dflash_hf.testing import tiny  # noqa: E402


def test_assets_decode_losslessly_with_both_drafts(tmp_path):
    tiny_serving_assets.main(["--out", str(tmp_path), "--steps", "2", "--train_prompts", "4", "--eval_prompts", "2",
                              "--new_tokens", "12"])  # fmt: skip
    prompts = [json.loads(line)["text"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 2
    target = load_target(str(tmp_path / "target"))
    tokenizer = tiny.build_tokenizer()
    ids = torch.tensor([tokenizer(prompts[0], add_special_tokens=False)["input_ids"]])
    greedy = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    for variant in ("dflash", "dflash2"):
        draft = load_draft_strict(tmp_path / f"draft_{variant}")
        assert draft.config.variant == variant and draft.config.block_size == 8
        out = speculative_generate(draft, target, 12, input_ids=ids)
        assert torch.equal(out.sequences, greedy)
