"""What serving engines read from an export, written as the draft was trained: top-level `is_causal: false`, the
draft's own full-head 1-D RoPE (never a speech target's multimodal RoPE fields), a distinct architecture name for
drafts outside the published contract, a mask id inside the target's embedding, and the model card's commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModel
from utils import make_args, require_vllm

from dflash_hf import DFlash2DraftModel, DFlashConfig, DFlashDraftModel
from dflash_hf.export.drafts import check_draft_export, export_draft, load_draft_strict
from dflash_hf.export.hub import DraftCardInfo, build_model_card, serving_commands, target_serving_facts
from dflash_hf.models.configuration_dflash import TARGET_ONLY_ROPE_KEYS
from dflash_hf.targets.builder import build_target_and_draft
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny

# what a Qwen3-ASR (or Qwen3-Omni) text config carries beside the theta
MROPE = {"mrope_section": [2, 1, 1], "mrope_interleaved": True, "interleaved": True, "partial_rotary_factor": 0.5}
THETA = 1_000_000.0


def _keys(obj) -> set[str]:
    """Every key of a JSON object, nested ones included."""
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in _keys(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in _keys(v)}
    return set()


@pytest.fixture(scope="module")
def mrope_asr():
    """A tiny Qwen3-ASR target whose text config carries multimodal RoPE fields and a partial rotary factor."""
    model, processor = tiny.build_qwen3_asr_target(hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)
    model.config.text_config.rope_parameters = {"rope_type": "default", "rope_theta": THETA, **MROPE}
    return model, processor


def _asr_draft(tmp_path, model, **kw) -> DFlashDraftModel:
    mask = tiny.build_tokenizer().convert_tokens_to_ids(tiny.MASK_TOKEN)
    torch.manual_seed(0)
    return build_target_and_draft(FrozenTarget(model), make_args(tmp_path, mask_token_id=mask, **kw)).draft.eval()


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_export_of_a_speech_target_draft_writes_its_own_rope_and_is_causal_false(mrope_asr, tmp_path, variant):
    model, _ = mrope_asr
    extra = {"conv_group_size": 8, "selector_rank": 4, "selector_top_k": 2} if variant == "dflash2" else {}
    draft = _asr_draft(tmp_path, model, variant=variant, **extra)
    raw = json.loads((export_draft(draft, tmp_path / "draft") / "config.json").read_text())
    assert raw["is_causal"] is False
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": THETA} and raw["rope_theta"] == THETA
    assert not _keys(raw) & set(TARGET_ONLY_ROPE_KEYS), sorted(_keys(raw) & set(TARGET_ONLY_ROPE_KEYS))
    # what the rotary computes: full-head rotation (head_dim / 2 frequencies) at that theta
    rotary = load_draft_strict(tmp_path / "draft").rotary_emb
    head_dim = raw["head_dim"]
    expected = 1.0 / THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    assert torch.equal(rotary.inv_freq(torch.device("cpu")), expected)


def _save_legacy(draft: DFlashDraftModel, directory: Path, edit) -> Path:
    """An export as written before the serving fields: no `is_causal`, edited by `edit(config_dict)`."""
    draft.save_pretrained(directory)
    raw = json.loads((directory / "config.json").read_text())
    raw.pop("is_causal", None)
    edit(raw)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def test_older_export_with_target_rope_fields_loads_and_computes_the_same(mrope_asr, tmp_path):
    model, _ = mrope_asr
    draft = _asr_draft(tmp_path, model)
    legacy = _save_legacy(draft, tmp_path / "old", lambda raw: raw["rope_parameters"].update(MROPE))
    cfg = draft.config
    taps = torch.randn(1, 5, cfg.num_taps * cfg.hidden_size)
    noise = torch.randn(1, cfg.block_size, cfg.hidden_size)
    pos = torch.arange(5 + cfg.block_size)[None] + 7
    with torch.no_grad():
        expected = draft(position_ids=pos, noise_embedding=noise, target_hidden=taps)
        for loaded in (load_draft_strict(legacy).eval(), AutoModel.from_pretrained(legacy, trust_remote_code=True)):
            assert loaded.config.is_causal is False
            assert loaded.config.rope_parameters == {"rope_type": "default", "rope_theta": THETA}
            assert torch.equal(loaded(position_ids=pos, noise_embedding=noise, target_hidden=taps), expected)
    again = json.loads((export_draft(load_draft_strict(legacy), tmp_path / "again") / "config.json").read_text())
    assert again["is_causal"] is False and not _keys(again) & set(TARGET_ONLY_ROPE_KEYS)


def test_config_claiming_causal_attention_is_refused(mrope_asr, tmp_path):
    draft = _asr_draft(tmp_path, mrope_asr[0])
    for key, edit in (
        ("is_causal", lambda raw: raw.update(is_causal=True)),
        ("dflash_config.causal", lambda raw: raw["dflash_config"].update(causal=True)),
    ):
        directory = _save_legacy(draft, tmp_path / key, edit)
        with pytest.raises(ValueError, match="is_causal / dflash_config.causal is true"):
            load_draft_strict(directory)


def _context_config(variant: str) -> DFlashConfig:
    text = tiny.build_text_target(hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1).config
    extra = {"conv_group_size": 8, "selector_rank": 4, "selector_top_k": 2} if variant == "dflash2" else {}
    return DFlashConfig.from_target_config(
        text, mask_token_id=5, variant=variant, num_hidden_layers=1, block_size=4, encoder_hidden_size=16, **extra
    )


def _published_config(variant: str) -> DFlashConfig:
    """`_context_config(variant)` without its encoder context: a draft inside the published contract."""
    config = _context_config(variant)
    config.dflash_config.pop("encoder_hidden_size")
    config.dflash_config.pop("outside_published_contract")
    config.architectures = ["DFlash2DraftModel" if variant == "dflash2" else "DFlashDraftModel"]
    return config


@pytest.mark.parametrize(
    ("variant", "name"), [("dflash", "DFlashEncoderContextDraftModel"), ("dflash2", "DFlash2EncoderContextDraftModel")]
)
def test_draft_outside_the_contract_gets_an_architecture_no_engine_knows_and_still_loads(tmp_path, variant, name):
    config = _context_config(variant)
    torch.manual_seed(0)
    draft = (DFlashDraftModel if variant == "dflash" else DFlash2DraftModel)(config)
    # (transformers keys remote code by directory name: one per variant, or AutoModel reuses the first class loaded)
    out = export_draft(draft, tmp_path / f"ctx_{variant}")
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == [name] and raw["is_causal"] is False
    for loaded in (load_draft_strict(out), AutoModel.from_pretrained(out, trust_remote_code=True)):
        assert loaded.config.encoder_context and loaded.config.variant == variant
        assert type(loaded).__name__ == type(draft).__name__
        sd = loaded.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in draft.state_dict().items())
    # an export of such a draft made before the distinct name (the contract name, no is_causal) still loads
    contract = "DFlashDraftModel" if variant == "dflash" else "DFlash2DraftModel"
    legacy = _save_legacy(draft, tmp_path / "legacy", lambda raw: raw.update(architectures=[contract]))
    assert load_draft_strict(legacy).config.encoder_context
    assert json.loads((export_draft(load_draft_strict(legacy), tmp_path / "re") / "config.json").read_text())[
        "architectures"
    ] == [name]


def test_outside_contract_name_without_encoder_context_is_refused(tmp_path):
    config = _context_config("dflash")
    config.dflash_config.pop("encoder_hidden_size")
    config.architectures = ["DFlashEncoderContextDraftModel"]
    with pytest.raises(ValueError, match="encoder-context draft but dflash_config has no encoder_hidden_size"):
        config.validate_dflash()


@pytest.mark.parametrize("mask", [40, -1, "5", True])
def test_mask_id_outside_the_targets_embedding_is_refused(mask):
    config = _context_config("dflash")
    config.vocab_size = 40
    config.dflash_config["mask_token_id"] = mask
    with pytest.raises(ValueError, match="mask_token_id"):
        config.validate_dflash()


def test_export_checks_the_mask_id_against_the_target_and_its_tokenizer(tmp_path):
    tok = tiny.build_tokenizer()
    model = tiny.build_text_target(tok, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)
    rows = model.get_input_embeddings().weight.shape[0]

    def draft(mask: int) -> DFlashDraftModel:
        cfg = DFlashConfig.from_target_config(model.config, mask_token_id=mask, num_hidden_layers=1, block_size=4)
        return DFlashDraftModel(cfg)

    good = draft(tok.convert_tokens_to_ids(tiny.MASK_TOKEN))
    export_draft(good, tmp_path / "ok", vocab_size=rows, tokenizer=tok)
    with pytest.raises(ValueError, match="differs from the target's"):
        export_draft(good, tmp_path / "other", vocab_size=rows + 8)
    with pytest.raises(ValueError, match=r"has no row in the target's embedding \(30 rows\)"):
        export_draft(good, tmp_path / "small", vocab_size=30)
    with pytest.raises(ValueError, match="is the tokenizer's eos_token"):
        export_draft(draft(tok.eos_token_id), tmp_path / "eos", tokenizer=tok)
    assert not (tmp_path / "other").exists() and not (tmp_path / "eos").exists()


def test_model_card_serving_commands_follow_the_export(tmp_path):
    config = _context_config("dflash2")
    outside = build_model_card(config, "me/ctx", DraftCardInfo(target_id="openai/whisper-tiny"))
    assert "vllm serve" not in outside and "sglang" not in outside and "Outside the published DFlash" in outside
    assert serving_commands(config, "me/ctx", "t") == {}

    config = _published_config("dflash2")
    config.set_block_size(8)
    unmeasured = DraftCardInfo(target_id="HuggingFaceTB/SmolLM2-135M-Instruct", target_architecture="LlamaForCausalLM")
    assert serving_commands(config, "me/draft", unmeasured.target_id, info=unmeasured) == {}  # no measured row
    text = DraftCardInfo(target_id="Qwen/Qwen3-0.6B", target_architecture="Qwen3ForCausalLM")
    commands = serving_commands(config, "me/draft", text.target_id, info=text)
    assert list(commands) == ["vllm"]  # the measured pair only: vLLM with a Qwen3 text target; no SGLang command
    spec = json.loads(commands["vllm"].split("--speculative-config '")[1].rstrip("'"))
    assert spec == {"method": "dflash", "model": "me/draft", "num_speculative_tokens": 7}
    assert commands["vllm"].startswith("vllm serve Qwen/Qwen3-0.6B")
    card = build_model_card(config, "me/draft", text)
    assert commands["vllm"] in card and "vLLM 0.34 serves this draft with its text target" in card
    assert "block_size" not in commands["vllm"] and "num-draft-tokens" not in card and "sglang" not in card.lower()
    check = DFlashConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert check.architecture == "DFlash2DraftModel" and check.in_published_contract


@pytest.mark.parametrize(
    ("architecture", "text_type", "says"),
    [
        ("Qwen2AudioForConditionalGeneration", "qwen2", "The dflash_hf plugin registers a hidden-state variant"),
        ("LlamaForCausalLM", None, "No serving engine has been measured with LlamaForCausalLM"),
        ("Qwen2AudioForConditionalGeneration", "llama", "vLLM cannot serve this target: vLLM's Qwen2Audio"),
        ("VoxtralForConditionalGeneration", "llama", "loads Mistral-format checkpoints only"),
        ("WhisperForConditionalGeneration", None, "No serving engine has been measured with Whisper"),
        (None, None, "The target's architecture was not given"),
    ],
)
def test_model_card_prints_no_command_for_a_pair_without_a_measured_row(architecture, text_type, says):
    config = _published_config("dflash")
    info = DraftCardInfo(target_id="org/t", target_architecture=architecture, target_text_model_type=text_type)
    card = build_model_card(config, "me/draft", info)
    assert says in card and "vllm serve" not in card and "sglang" not in card.lower()
    assert serving_commands(config, "me/draft", "org/t", info=info) == {}


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_model_card_prints_the_measured_qwen3_asr_pair_only(variant):
    config = _published_config(variant)
    info = DraftCardInfo(target_id="org/asr", target_architecture="Qwen3ASRForConditionalGeneration")
    card = build_model_card(config, "me/draft", info)
    commands = serving_commands(config, "me/draft", "org/asr", info=info)
    assert "add_vllm_serving_fields" in card and "sglang" not in card.lower()
    if variant == "dflash":  # measured: the demo's tiny Qwen3-ASR and a 1.7B-shaped one, DFlash drafts
        assert list(commands) == ["vllm"] and commands["vllm"] in card
        assert "vLLM 0.34 serves this draft with its Qwen3-ASR target" in card
    else:
        assert commands == {} and "vllm serve" not in card and "DFlash2 draft with one has not been measured" in card


@pytest.mark.parametrize(
    ("architecture", "text_type", "variant", "measured"),
    [
        ("Qwen2AudioForConditionalGeneration", "qwen2", "dflash2", True),  # the plugin row of docs/SERVING.md
        ("Qwen2AudioForConditionalGeneration", "qwen2", "dflash", False),
        ("AudioFlamingo3ForConditionalGeneration", "qwen2", "dflash2", False),
        ("Qwen2AudioForConditionalGeneration", "llama", "dflash2", False),  # refused by the plugin
    ],
)
def test_model_card_prints_the_measured_plugin_pair_only(architecture, text_type, variant, measured):
    config = _published_config(variant)
    info = DraftCardInfo(target_id="org/slm", target_architecture=architecture, target_text_model_type=text_type)
    card = build_model_card(config, "me/draft", info)
    commands = serving_commands(config, "me/draft", "org/slm", info=info)
    assert "sglang" not in card.lower()
    if measured:
        assert list(commands) == ["vllm"] and commands["vllm"] in card
        assert "vLLM 0.34 with the dflash_hf plugin serves this draft" in card and "install\ndflash_hf" in card
    else:
        assert commands == {} and "vllm serve" not in card


def test_target_serving_facts_read_the_targets_config():
    model, _ = tiny.build_qwen3_asr_target(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    facts = target_serving_facts(model.config)
    assert facts == {
        "target_architecture": None,  # not saved: no architectures
        "target_text_model_type": "qwen3",
        "target_vllm_fields_missing": (),  # the tiny target carries vLLM's serving fields
    }
    model.config.architectures = ["Qwen3ASRForConditionalGeneration"]
    assert target_serving_facts(model.config)["target_architecture"] == "Qwen3ASRForConditionalGeneration"
    assert target_serving_facts(tiny.build_text_target(hidden_size=32, num_layers=2, num_heads=2).config) == {
        "target_architecture": None,
        "target_text_model_type": None,
        "target_vllm_fields_missing": (),
    }
    raw = {"architectures": ["Qwen2AudioForConditionalGeneration"], "text_config": {"model_type": "llama"}}
    assert target_serving_facts(raw) == {
        "target_architecture": "Qwen2AudioForConditionalGeneration",
        "target_text_model_type": "llama",
        "target_vllm_fields_missing": (),
    }  # a config.json as it is (what dflash-train's --push_to_hub reads)
    asr = model.config.to_dict()
    del asr["audio_config"]["conv_chunksize"]
    assert target_serving_facts(asr)["target_vllm_fields_missing"] == ("conv_chunksize",)


def test_model_card_gives_no_command_for_a_qwen3_asr_target_vllm_cannot_build():
    config = _published_config("dflash")
    info = DraftCardInfo(
        target_id="org/asr",
        target_architecture="Qwen3ASRForConditionalGeneration",
        target_vllm_fields_missing=("conv_chunksize", "max_source_positions"),
    )
    card = build_model_card(config, "me/draft", info)
    assert "vllm serve" not in card and serving_commands(config, "me/draft", "org/asr", info=info) == {}
    assert "cannot build this target: its `audio_config` lacks conv_chunksize, max_source_positions" in card


def test_check_draft_export_accepts_both_architecture_names(tmp_path):
    torch.manual_seed(0)
    out = export_draft(DFlashDraftModel(_context_config("dflash")), tmp_path / "ctx")
    assert check_draft_export(out).architecture == "DFlashEncoderContextDraftModel"


def test_with_vllm_an_export_reads_as_it_was_trained(mrope_asr, tmp_path):
    """vLLM's own readers on an export of the speech target's draft: non-causal, the mask id, the taps + 1, and a
    full-head 1-D rotary equal to the draft's (the target's fields would make it a half-head multimodal rotary)."""
    require_vllm()
    from types import SimpleNamespace

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.transformers_utils.config import get_config
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    draft = _asr_draft(tmp_path, mrope_asr[0])
    config = get_config(str(export_draft(draft, tmp_path / "draft")), trust_remote_code=False)
    assert dflash_has_any_non_causal(config) and config.is_causal is False
    assert get_parallel_drafting_token_id(config) == draft.config.mask_token_id
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=config))
    assert get_eagle3_aux_layers_from_config(spec) == tuple(i + 1 for i in draft.config.target_layer_ids)
    head_dim, positions = config.head_dim, torch.arange(64)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        rope = get_rope(head_dim, max_position=64, is_neox_style=True, rope_parameters=config.rope_parameters)
        target_rope = get_rope(
            head_dim,
            max_position=64,
            is_neox_style=True,
            rope_parameters=mrope_asr[0].config.text_config.rope_parameters,
        )
    assert type(rope).__name__ == "RotaryEmbedding" and rope.rotary_dim == head_dim
    assert target_rope.rotary_dim < head_dim  # what copying the target's fields would have served
    cos, sin = draft.rotary_emb(positions[None], torch.float32)
    half = head_dim // 2
    assert torch.allclose(rope.cos_sin_cache, torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1), atol=1e-6)
