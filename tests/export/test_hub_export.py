"""What `export_draft` writes for serving engines: readable files, the activation the draft computes, top-level
rope_theta (engines whose config classes predate `rope_parameters` read only that key)."""

from __future__ import annotations

import json
import stat

import torch
from utils import tiny_draft_config

from dflash_hf import DFlashDraftModel
from dflash_hf.export import convert_dflash_to_dflash2, export_draft, load_draft_strict


def test_export_files_are_0644_with_top_level_rope_theta(tmp_path):
    torch.manual_seed(0)
    config = tiny_draft_config(
        {"mask_token_id": 5, "target_layer_ids": [1, 2]},
        block_size=8,
        num_target_layers=4,
        hidden_size=32,
        head_dim=8,
        vocab_size=40,
        rope_parameters={"rope_type": "default", "rope_theta": 123456.0},
    )
    out = export_draft(DFlashDraftModel(config), tmp_path / "draft")
    dflash2 = convert_dflash_to_dflash2(out, tmp_path / "dflash2", conv_group_size=8, selector_rank=4, selector_top_k=2)
    for directory in (out, dflash2):
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}
        assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
        raw = json.loads((directory / "config.json").read_text())
        assert raw["rope_theta"] == 123456.0 == raw["rope_parameters"]["rope_theta"]
        assert raw["hidden_act"] == "silu"
    assert load_draft_strict(out).rotary_emb.rope_theta == 123456.0
