"""Shipped adaptation YAML configs parse into DFlashTrainingArguments with the documented values."""

from __future__ import annotations

import pytest
import torch
from transformers import HfArgumentParser, get_scheduler
from utils import REPO_ROOT, tiny_draft_config

from dflash_hf import DFlashDraftModel, DFlashTrainingArguments
from dflash_hf.cli.config import parse_with_config

CONFIGS = REPO_ROOT / "examples" / "configs"


def _parse(name: str, *flags: str) -> DFlashTrainingArguments:
    (args,) = parse_with_config(HfArgumentParser(DFlashTrainingArguments), ["--config", str(CONFIGS / name), *flags])
    return args


def test_adapt_schedule(tmp_path):
    args = _parse("adapt.yaml", "--output_dir", str(tmp_path))
    assert (args.learning_rate, args.adam_beta1, args.adam_beta2, args.adam_epsilon) == (1.5e-4, 0.9, 0.999, 1e-8)
    assert args.weight_decay == 0.0 and args.optim.value == "adamw_torch"
    assert (args.warmup_steps, args.max_steps) == (500, 8000)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    kw = args.lr_scheduler_kwargs
    sched = get_scheduler(args.lr_scheduler_type, opt, args.warmup_steps, args.max_steps, scheduler_specific_kwargs=kw)
    lrs = [args.learning_rate * sched.lr_lambdas[0](step) for step in range(args.max_steps + 1)]
    assert lrs[0] == 0.0 and lrs[500] == pytest.approx(1.5e-4)
    assert lrs[-1] == pytest.approx(1e-6, rel=1e-2) and min(lrs[500:]) >= 1e-6 - 1e-12


def test_block8_to_block16_requires_a_real_draft(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"init_from_pretrained='/path/to/block8-draft'"):
        _parse("adapt_block8_to_block16.yaml", "--output_dir", str(tmp_path)).check_files()
    draft = tmp_path / "block8"
    draft.mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json; it is not a DFlash draft export"):
        _parse(
            "adapt_block8_to_block16.yaml", "--output_dir", str(tmp_path), "--init_from_pretrained", str(draft)
        ).check_files()
    config = tiny_draft_config(
        {"mask_token_id": 5, "target_layer_ids": [1, 2]},
        block_size=8,
        num_target_layers=4,
        hidden_size=32,
        head_dim=8,
        vocab_size=40,
    )
    DFlashDraftModel(config).save_pretrained(draft)
    args = _parse("adapt_block8_to_block16.yaml", "--output_dir", str(tmp_path), "--init_from_pretrained", str(draft))
    assert (args.variant, args.block_size, args.projection_only) == ("dflash2", 16, True)
    assert args.use_fused_linear_ce is False
    assert (args.label_source, args.target_argmax_chunk_size) == ("target_argmax", 128)
