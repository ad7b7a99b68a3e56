"""The weight names vLLM's audio-LLM classes read (`dflash_hf.serving.checkpoint_layout`): the renaming of the layout
transformers 5.17 to 5.22 save, on the names a tiny target saved by the installed transformers gets and on that
layout; the rewrite of a saved checkpoint (one file, shards and their index), what it refuses, and transformers
loading the rewritten checkpoint with the same weights; with vLLM importable, its loader given that layout through
the plugin's variant."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys

import pytest
import torch
import transformers as tf
from packaging.version import Version
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from utils import doubled_name, require_vllm

from dflash_hf.serving import checkpoint_layout
from dflash_hf.serving.checkpoint_layout import DOUBLED_PREFIX, rename_map, renamed_weights

QWEN2_AUDIO = "Qwen2AudioForConditionalGeneration"
TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
WHISPER_LIKE = dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16)


def _tiny(arch: str, seed: int = 0) -> tf.PreTrainedModel:
    """A tiny random target of `arch` (transformers' class of the same name), its text model of the type vLLM's class
    builds."""
    configs = {
        QWEN2_AUDIO: lambda: tf.Qwen2AudioConfig(
            audio_config=WHISPER_LIKE, text_config=dict(model_type="qwen2", **TEXT)
        ),
        "AudioFlamingo3ForConditionalGeneration": lambda: tf.AudioFlamingo3Config(
            audio_config=WHISPER_LIKE, text_config=dict(model_type="qwen2", **TEXT)
        ),
        "GlmAsrForConditionalGeneration": lambda: tf.GlmAsrConfig(
            audio_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_mel_bins=16
            ),
            text_config=dict(model_type="llama", **TEXT),
        ),
    }
    torch.manual_seed(seed)
    return getattr(tf, arch)(configs[arch]()).eval()


def _names(folder) -> set[str]:
    names = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            names |= set(f.keys())
    return names


def _double_on_disk(folder) -> None:
    """Rewrite a saved checkpoint into the layout transformers 5.17 to 5.22 save (what the installed one may not)."""
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            metadata = f.metadata()
        save_file({doubled_name(k): v for k, v in load_file(file).items()}, file, metadata=metadata)
    index = folder / checkpoint_layout.INDEX_FILE
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {doubled_name(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data))


def _vllm_language_model_names(model) -> set[str]:
    """The names vLLM's class reads for the target's language model: the text model's own checkpoint names (what
    vLLM's Qwen2ForCausalLM / LlamaForCausalLM read) under `language_model.`; the head left out (tied or not)."""
    text = tf.AutoModelForCausalLM.from_config(model.config.text_config)
    return {f"language_model.{name}" for name in text.state_dict() if name.startswith("model.")}


@pytest.mark.parametrize("arch", sorted(checkpoint_layout.SAVED_TO_VLLM))
def test_the_rule_gives_the_names_vllm_reads_from_either_layout(arch, tmp_path):
    model = _tiny(arch)
    model.save_pretrained(tmp_path)
    saved = _names(tmp_path)
    doubled = Version(Version(tf.__version__).base_version) < Version("5.23")
    assert any(name.startswith(DOUBLED_PREFIX) for name in saved) == doubled  # the installed transformers' layout
    want = _vllm_language_model_names(model)
    for names in (saved, {doubled_name(name) for name in saved}):
        renames = rename_map(arch, names)
        assert set(renames) == {name for name in names if name.startswith(DOUBLED_PREFIX)}
        for_vllm = {renames.get(name, name) for name in names}
        assert {name for name in for_vllm if name.startswith("language_model.model.")} == want
        assert not any(DOUBLED_PREFIX in name for name in for_vllm)


def test_the_rule_renames_nothing_of_other_architectures():
    name = "language_model.model.model.layers.0.mlp.up_proj.weight"
    for arch in ("VoxtralForConditionalGeneration", "Qwen3ASRForConditionalGeneration", "Qwen2ForCausalLM"):
        assert checkpoint_layout.vllm_name(arch, name) == name
        assert rename_map(arch, [name]) == {}
    assert checkpoint_layout.vllm_name(QWEN2_AUDIO, name) == "language_model.model.layers.0.mlp.up_proj.weight"


def test_the_stream_is_renamed_and_one_line_logged(caplog):
    weights = [("language_model.model.model.norm.weight", 1), ("language_model.lm_head.weight", 2)]
    weights.append(("audio_tower.conv1.weight", 3))
    with caplog.at_level(logging.INFO, logger=checkpoint_layout.__name__):
        out = list(renamed_weights(QWEN2_AUDIO, iter(weights)))
    assert out == [("language_model.model.norm.weight", 1), ("language_model.lm_head.weight", 2), weights[2]]
    [record] = caplog.records
    assert "renamed 1 weight names of Qwen2AudioForConditionalGeneration" in record.getMessage()
    assert "transformers 5.17 to 5.22" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=checkpoint_layout.__name__):
        assert list(renamed_weights(QWEN2_AUDIO, weights[1:])) == weights[1:]
    assert not caplog.records  # nothing renamed, nothing logged


@pytest.mark.parametrize("plain_first", [True, False])
def test_a_stream_with_both_layouts_is_refused(plain_first):
    both = [("language_model.model.norm.weight", 0), ("language_model.model.model.norm.weight", 1)]
    with pytest.raises(ValueError, match="would collide with 'language_model.model.norm.weight'"):
        list(renamed_weights(QWEN2_AUDIO, both if plain_first else both[::-1]))


def _assert_same_weights(model, folder) -> None:
    loaded = type(model).from_pretrained(folder).state_dict()
    expected = model.state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_the_rewrite_gives_vllms_names_and_transformers_the_same_weights(shard, tmp_path):
    model = _tiny(QWEN2_AUDIO)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    index = tmp_path / checkpoint_layout.INDEX_FILE
    assert index.is_file() == bool(shard) and len(list(tmp_path.glob("*.safetensors"))) > (1 if shard else 0)
    _double_on_disk(tmp_path)
    doubled = _names(tmp_path)
    assert checkpoint_layout.rewrite_for_vllm(tmp_path) == sum(n.startswith(DOUBLED_PREFIX) for n in doubled) > 0
    names = _names(tmp_path)
    assert names == {checkpoint_layout.vllm_name(QWEN2_AUDIO, n) for n in doubled}
    assert {n for n in names if n.startswith("language_model.model.")} == _vllm_language_model_names(model)
    if shard:
        assert set(json.loads(index.read_text())["weight_map"]) == names
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            assert f.metadata() == {"format": "pt"}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary file left
    _assert_same_weights(model, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert checkpoint_layout.rewrite_for_vllm(tmp_path) == 0  # already vLLM's layout: untouched
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def _saved_tiny(folder):
    """A tiny Qwen2-Audio saved into `folder` in the layout transformers 5.17 to 5.22 save."""
    model = _tiny(QWEN2_AUDIO)
    model.save_pretrained(folder)
    _double_on_disk(folder)
    return model


def test_the_rewrite_refuses_a_folder_without_safetensors_or_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        checkpoint_layout.rewrite_for_vllm(tmp_path)
    config = _tiny(QWEN2_AUDIO).config
    config.architectures = [QWEN2_AUDIO]
    config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"holds no safetensors checkpoint \(model.safetensors or"):
        checkpoint_layout.rewrite_for_vllm(tmp_path)
    tf.Qwen2Config(**TEXT, architectures=["Qwen2ForCausalLM"]).save_pretrained(tmp_path / "text")
    with pytest.raises(ValueError, match=r"\['Qwen2ForCausalLM'\]: only a checkpoint of one of"):
        checkpoint_layout.rewrite_for_vllm(tmp_path / "text")


def test_the_rewrite_refuses_a_collision_and_leaves_the_checkpoint_as_it_was(tmp_path):
    _saved_tiny(tmp_path)
    file = tmp_path / checkpoint_layout.SINGLE_FILE
    tensors = load_file(file)
    tensors["language_model.model.norm.weight"] = tensors["language_model.model.model.norm.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})
    before = file.read_bytes()
    with pytest.raises(ValueError, match="'language_model.model.model.norm.weight' .* would collide"):
        checkpoint_layout.rewrite_for_vllm(tmp_path)
    assert file.read_bytes() == before


def test_the_rewrite_refuses_one_file_beside_an_index(tmp_path):
    _saved_tiny(tmp_path)
    (tmp_path / checkpoint_layout.INDEX_FILE).write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ValueError, match="holds both model.safetensors and model.safetensors.index.json"):
        checkpoint_layout.rewrite_for_vllm(tmp_path)


def test_a_failed_write_leaves_the_checkpoint_as_it_was(tmp_path, monkeypatch):
    import safetensors.torch

    _saved_tiny(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def full_disk(tensors, path, metadata=None):
        open(path, "wb").write(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        checkpoint_layout.rewrite_for_vllm(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # and no temporary file left


@pytest.mark.parametrize("stop_after", [1, 2, 3])  # replacements done before the kill (the index is the last)
def test_a_rewrite_killed_between_replacements_is_finished_by_the_next(stop_after, tmp_path, monkeypatch):
    model = _tiny(QWEN2_AUDIO)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    _double_on_disk(tmp_path)
    doubled = _names(tmp_path)
    real, done = os.replace, []

    def killed(src, dst):
        if len(done) == stop_after:
            raise KeyboardInterrupt("killed")
        done.append(dst)
        real(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_layout.rewrite_for_vllm(tmp_path)
    monkeypatch.setattr(os, "replace", real)
    assert checkpoint_layout.rewrite_for_vllm(tmp_path) > 0
    names = _names(tmp_path)
    assert names == {checkpoint_layout.vllm_name(QWEN2_AUDIO, n) for n in doubled}
    assert set(json.loads((tmp_path / checkpoint_layout.INDEX_FILE).read_text())["weight_map"]) == names
    _assert_same_weights(model, tmp_path)
    assert checkpoint_layout.rewrite_for_vllm(tmp_path) == 0


# --- Against the real vLLM, where it is importable ------------------------------------------------------------------
def test_with_vllm_the_variant_loads_the_layout_its_class_refuses(tmp_path):
    """vLLM's own loader (`AutoWeightsLoader`, what its Qwen2-Audio's `load_weights` runs) over a model with its
    class's module names, built from transformers' modules (vLLM's need an engine): vLLM's class refuses the doubled
    layout; the plugin's variant loads every weight."""
    require_vllm()
    from vllm.model_executor.models.qwen2_audio import Qwen2AudioForConditionalGeneration as VllmQwen2Audio

    sys.modules.pop("dflash_hf.serving.vllm_models", None)
    variant = importlib.import_module(
        "dflash_hf.serving.vllm_models"
    ).Qwen2AudioForConditionalGenerationWithHiddenStates
    saved = _saved_tiny(tmp_path)
    weights = load_file(tmp_path / checkpoint_layout.SINGLE_FILE)
    assert any(name.startswith(DOUBLED_PREFIX) for name in weights)

    def with_vllms_names(cls):
        model, other = cls.__new__(cls), _tiny(QWEN2_AUDIO, seed=1)  # other weights than the checkpoint's
        nn.Module.__init__(model)
        model.audio_tower, model.multi_modal_projector = other.model.audio_tower, other.model.multi_modal_projector
        model.language_model = tf.AutoModelForCausalLM.from_config(other.config.text_config)
        return model

    with pytest.raises(ValueError, match=r"no module or parameter named '(language_model\.model\.)?model'"):
        VllmQwen2Audio.load_weights(with_vllms_names(VllmQwen2Audio), iter(weights.items()))
    model = with_vllms_names(variant)
    loaded = model.load_weights(iter(weights.items()))
    assert loaded == {checkpoint_layout.vllm_name(QWEN2_AUDIO, name) for name in weights}
    expected = saved.state_dict()
    for name, tensor in model.state_dict().items():
        hf_name = name.replace("language_model.model.", "model.language_model.").replace(
            "language_model.lm_head", "lm_head"
        )
        hf_name = hf_name if hf_name in expected else f"model.{name}"
        assert torch.equal(tensor, expected[hf_name]), name
