"""Strict weights-only warm start (`dflash_hf.export.drafts.load_draft_strict`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from utils import tiny_draft_config

from dflash_hf import DFlashDraftModel
from dflash_hf.export import load_draft_strict

HIDDEN = 32


def _draft(block_size: int = 8) -> DFlashDraftModel:
    torch.manual_seed(0)
    config = tiny_draft_config(
        {"mask_token_id": 5, "target_layer_ids": [1, 2]},
        block_size=block_size,
        num_target_layers=4,
        hidden_size=HIDDEN,
        head_dim=8,
        vocab_size=40,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return DFlashDraftModel(config)


@pytest.fixture
def export(tmp_path) -> tuple[DFlashDraftModel, Path]:
    draft = _draft()
    draft.save_pretrained(tmp_path / "draft")
    return draft, tmp_path / "draft"


def _edit_config(directory: Path, fn) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    fn(cfg)
    (directory / "config.json").write_text(json.dumps(cfg))


def _edit_weights(directory: Path, fn) -> None:
    state = load_file(str(directory / "model.safetensors"))
    fn(state)
    save_file(state, str(directory / "model.safetensors"))


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.compat
def test_roundtrip_and_block_size_override(export, tmp_path):
    draft, path = export
    same = load_draft_strict(path)
    assert type(same) is DFlashDraftModel and same.config.block_size == 8
    _assert_same_weights(draft, same)

    bigger = load_draft_strict(path, block_size=16)
    _assert_same_weights(draft, bigger)
    assert bigger.config.block_size == 16 and bigger.config.dflash_config["block_size"] == 16
    bigger.save_pretrained(tmp_path / "b16")
    saved = json.loads((tmp_path / "b16" / "config.json").read_text())
    assert saved["block_size"] == 16 and saved["dflash_config"]["block_size"] == 16
    assert saved["dflash_config"]["target_layer_ids"] == [1, 2] and saved["dflash_config"]["mask_token_id"] == 5


def test_block_size_from_dflash_config_only(export):
    _, path = export

    def drop_top_level(cfg):
        del cfg["block_size"]
        cfg["dflash_config"]["block_size"] = 10

    _edit_config(path, drop_top_level)
    assert load_draft_strict(path).config.block_size == 10


def test_sharded_export(tmp_path):
    draft = _draft()
    draft.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    _assert_same_weights(draft, load_draft_strict(tmp_path / "sharded"))


def test_every_bad_tensor_is_named(export):
    _, path = export

    def corrupt(state):
        del state["layers.1.mlp.up_proj.weight"]
        del state["hidden_norm.weight"]
        state["embed_tokens.weight"] = torch.zeros(40, HIDDEN)
        state["fc.weight"] = torch.zeros(HIDDEN, 3 * HIDDEN)

    _edit_weights(path, corrupt)
    with pytest.raises(ValueError) as err:
        load_draft_strict(path)
    msg = str(err.value)
    for name in ("layers.1.mlp.up_proj.weight", "hidden_norm.weight", "embed_tokens.weight", "fc.weight"):
        assert name in msg
    assert "(32, 96)" in msg and "(32, 64)" in msg


def test_extra_files_ignored_with_note(export, caplog):
    draft, path = export
    save_file({"mask_embedding": torch.zeros(HIDDEN)}, str(path / "mask_embedding.safetensors"))
    with caplog.at_level(logging.WARNING, logger="dflash_hf.export.hub"):
        loaded = load_draft_strict(path)
    assert "mask_embedding.safetensors" in caplog.text
    _assert_same_weights(draft, loaded)


def test_quantization_config_refused(export):
    _, path = export
    _edit_config(path, lambda cfg: cfg.update(quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4"}))
    with pytest.raises(ValueError, match=r"quantization_config.*BF16 or FP32 export"):
        load_draft_strict(path)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_packed_tensors_refused(export, dtype):
    _, path = export

    def pack(state):
        w = state.pop("layers.0.self_attn.q_proj.weight")
        state["layers.0.self_attn.q_proj.weight"] = torch.zeros(w.shape[0], w.shape[1] // 2, dtype=torch.uint8)
        state["layers.0.self_attn.q_proj.weight_scale"] = torch.ones(w.shape[0], w.shape[1] // 16).to(dtype)

    _edit_weights(path, pack)
    with pytest.raises(ValueError, match=r"packed/quantized dtypes.*q_proj\.weight.*BF16 or FP32 export"):
        load_draft_strict(path)


def test_bf16_export_loads(export, tmp_path):
    draft, _ = export
    draft.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    loaded = load_draft_strict(tmp_path / "bf16")
    assert loaded.fc.weight.dtype == torch.float32
    assert torch.equal(loaded.fc.weight, draft.fc.weight.float())


def test_bad_directory_and_architecture(export, tmp_path):
    _, path = export
    with pytest.raises(FileNotFoundError, match="init_from_pretrained"):
        load_draft_strict(tmp_path / "does-not-exist")
    _edit_config(path, lambda cfg: cfg.update(architectures=["Qwen3ForCausalLM"]))
    with pytest.raises(ValueError, match="architectures"):
        load_draft_strict(path)


def test_published_style_config_loads(export):
    """Configs written by the reference DFlash code (transformers 4 keys: rope_theta, rope_scaling, torch_dtype)."""
    draft, path = export

    def v4_style(cfg):
        cfg.pop("rope_parameters")
        cfg.pop("dtype", None)
        cfg.update(rope_theta=10000.0, rope_scaling=None, torch_dtype="bfloat16", transformers_version="4.57.1")

    _edit_config(path, v4_style)
    loaded = load_draft_strict(path)
    _assert_same_weights(draft, loaded)
    assert loaded.rotary_emb.rope_theta == 10000.0 and loaded.config.target_layer_ids == [1, 2]


def test_warm_start_sizes_refuse_a_given_value_the_export_cannot_honour(caplog):
    """A warm start keeps the export's draft sizes: a value given that differs from it (and from the default) is
    refused; the default is replaced by the export's value with a log line."""
    from dflash_hf.targets.draft_checks import check_warm_start_sizes

    config = tiny_draft_config({"mask_token_id": 5, "target_layer_ids": [0, 1]})  # 2 layers
    defaults = {"num_draft_layers": 5}
    check_warm_start_sizes(config, {"num_draft_layers": 2}, defaults)
    with caplog.at_level(logging.INFO, logger="dflash_hf.export.hub"):
        check_warm_start_sizes(config, {"num_draft_layers": 5}, defaults)
    assert "num_draft_layers=2 from the export" in caplog.text
    with pytest.raises(ValueError, match=r"num_draft_layers=3 differs from the warm-started draft's 2"):
        check_warm_start_sizes(config, {"num_draft_layers": 3}, defaults)
