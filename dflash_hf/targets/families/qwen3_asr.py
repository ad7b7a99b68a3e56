"""Qwen3-ASR's frozen forward without the audio encoder's host reads.

transformers' `Qwen3ASREncoder` finds its attention windows on the device (`get_audio_cu_seqlens`: a `max().item()`
and a Python loop over the per-audio lengths) and, outside flash attention, splits the packed windows with
`lengths.tolist()` three times per layer: every one a read back to the host, a stream synchronize on a GPU (about
`3 L + 2 n + 4` a forward for `L` layers and `n` audios). The encoder takes precomputed windows (`cu_seqlens`) through
its keyword arguments, but `Qwen3ASRModel.forward` does not pass any to it. So the trainer's plan computes the windows
on the host from the collator's CPU `input_features_mask` (`host_facts`, transformers' own function on CPU tensors)
and the frozen target builds the decoder's `inputs_embeds` as that forward does (`forward_inputs`: the audio features
scattered into the placeholders), with the windows on the host: the splits read nothing from the device. Taps and
final states are bit-identical to the model's own forward (`tests/targets/test_families.py`); one read is left,
the encoder's `nonzero` of its valid frames.

Serving: vLLM's Qwen3-ASR (its audio encoder, `Qwen3OmniMoeAudioEncoder`) reads two audio-config fields that
transformers' `Qwen3ASREncoderConfig` does not define, so a target saved by transformers does not build in vLLM
(`AttributeError` at model construction). `add_vllm_serving_fields` writes them with values under which vLLM computes
what transformers computes; `missing_vllm_serving_fields` names those a config lacks (`dflash-train` warns).
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

from dflash_hf.targets.families.base import config_field

logger = logging.getLogger(__name__)

WINDOWS_KEY = "audio_cu_seqlens"  # the encoder's windows, `[num_windows + 1]` int32 on the host
# What each field means to vLLM 0.33 / 0.34 (`qwen3_omni_moe_thinker.Qwen3OmniMoeAudioEncoder`), and the value written:
# - conv_chunksize (read with no default): how many 100-frame chunks its convolution stack takes in one call; larger
#   inputs are split along the chunk axis, which changes memory, not results (each chunk is convolved on its own, as
#   transformers does). Written: 500, the value of the original Qwen3-ASR checkpoints.
# - max_source_positions (0.34: default 1500; 0.33: no default): rows of the sinusoidal position table. Rows depend
#   only on the position, and a chunk uses its first `time_steps` rows (13 for 100 frames). Written: transformers' own
#   table length, `max_position_embeddings`.
VLLM_CONV_CHUNKSIZE = 500
VLLM_SERVING_FIELD_NAMES = ("conv_chunksize", "max_source_positions")


def vllm_serving_fields(audio_config) -> dict[str, int]:
    """The audio-config fields vLLM's Qwen3-ASR reads that transformers' config lacks, with the values to write."""
    values = (VLLM_CONV_CHUNKSIZE, int(audio_config.max_position_embeddings))
    return dict(zip(VLLM_SERVING_FIELD_NAMES, values))


def _audio_config(config):
    return config_field(config, "audio_config") if config_field(config, "model_type") == "qwen3_asr" else None


def missing_vllm_serving_fields(config) -> list[str]:
    """The `audio_config` fields vLLM needs that a Qwen3-ASR `config` (a transformers config, or its `config.json`
    as a dict) lacks ([] for other targets)."""
    audio = _audio_config(config)
    if audio is None:
        return []
    return [name for name in VLLM_SERVING_FIELD_NAMES if config_field(audio, name) is None]


def add_vllm_serving_fields(config) -> list[str]:
    """Write the missing vLLM serving fields into a Qwen3-ASR `config` (in place; `save_pretrained` then carries them
    into config.json). Fields already set are kept. Returns the names written."""
    audio = _audio_config(config)
    missing = missing_vllm_serving_fields(config)
    for name in missing:
        setattr(audio, name, vllm_serving_fields(audio)[name])
    return missing


def warn_missing_vllm_serving_fields(config, where: str) -> None:
    """One warning naming the vLLM serving fields a Qwen3-ASR target's config lacks, and how to add them."""
    missing = missing_vllm_serving_fields(config)
    if missing:
        values = vllm_serving_fields(config.audio_config)
        logger.warning(
            "target %s: its audio_config lacks %s, which vLLM's Qwen3-ASR reads (it cannot build this target). Drafts "
            "train as usual; to serve the target in vLLM, add %s to audio_config in its config.json, or "
            "load it, call dflash_hf.targets.families.qwen3_asr.add_vllm_serving_fields(model.config) and "
            "save_pretrained it again",
            where,
            ", ".join(missing),
            ", ".join(f'"{name}": {values[name]}' for name in missing),
        )


@functools.cache
def _transformers_parts():
    """What `host_facts` uses of transformers' Qwen3-ASR, or None for a version whose encoder does not take
    precomputed windows (`get_audio_cu_seqlens(..., kwargs)`)."""
    try:
        from transformers.models.qwen3_asr import modeling_qwen3_asr as qwen3_asr
        from transformers.utils.generic import is_flash_attention_requested
    except ImportError:
        return None
    if "kwargs" not in inspect.signature(qwen3_asr.get_audio_cu_seqlens).parameters:
        return None
    return qwen3_asr, is_flash_attention_requested


def host_facts(model, batch: dict) -> dict | None:
    """The encoder's windows of a host `batch` (None where the model's own forward must run: another model class, a
    flash-attention encoder, whose windows must be on the device, a batch on a device, or one whose placeholders do not
    match its audio frames, which that forward reports)."""
    parts = _transformers_parts()
    if parts is None:
        return None
    qwen3_asr, is_flash_attention_requested = parts
    inner = getattr(model, "model", None)
    mask, ids = batch.get("input_features_mask"), batch.get("input_ids")
    if not isinstance(inner, qwen3_asr.Qwen3ASRModel) or not isinstance(inner.audio_tower, qwen3_asr.Qwen3ASREncoder):
        return None
    encoder = inner.audio_tower
    if mask is None or ids is None or mask.device.type != "cpu" or is_flash_attention_requested(encoder.config):
        return None
    rows, frames = mask.shape
    chunk = encoder.n_window * 2
    if frames % chunk:  # the encoder refuses it, by name
        return None
    feature_lens = mask.sum(-1).to(torch.long)  # as `Qwen3ASREncoder.forward` computes them
    chunk_lengths = mask.view(rows, frames // chunk, chunk).sum(dim=-1).reshape(-1).to(torch.long)
    placeholders = int((ids == inner.config.audio_token_id).sum())
    if placeholders != int(qwen3_asr._get_feat_extract_output_lengths(feature_lens, encoder.n_window).sum()):
        return None
    windows = qwen3_asr.get_audio_cu_seqlens(chunk_lengths, feature_lens, encoder.n_window_infer, encoder.n_window)
    return {WINDOWS_KEY: windows}


def forward_inputs(model, kwargs: dict, host: dict) -> dict:
    """`kwargs` with `input_ids` and the audio replaced by `inputs_embeds`, as `Qwen3ASRModel.forward` builds them, the
    encoder running on the host's windows."""
    inner = model.model
    ids = kwargs.pop("input_ids")
    audio = inner.get_audio_features(
        kwargs.pop("input_features"), kwargs.pop("input_features_mask"), cu_seqlens=host[WINDOWS_KEY], return_dict=True
    ).pooler_output
    embeds = inner.get_input_embeddings()(ids)
    placeholders = (ids == inner.config.audio_token_id).unsqueeze(-1).expand_as(embeds)
    kwargs["inputs_embeds"] = embeds.masked_scatter(placeholders, audio.to(embeds.device, embeds.dtype))
    return kwargs
