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
"""

from __future__ import annotations

import functools
import inspect

import torch

WINDOWS_KEY = "audio_cu_seqlens"  # the encoder's windows, `[num_windows + 1]` int32 on the host


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
