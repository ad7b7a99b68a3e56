"""The target families (`FAMILY_CLASSES`, one `TargetFamily` subclass each; `FAMILIES`: their instances by name),
`resolve_family` (which family a target config is), and what the rest of the package calls on a family:
`encode_batch` (the family's processor call) and `decoder_streams` (a collated batch as streams aligned 1:1 with the
decoder's positions after audio expansion, docs/ARCHITECTURE.md "Decoder streams").

The base class and the helpers families share are in ``base.py``; the decoder-only families (text, Qwen3-ASR,
Qwen2-Audio, Voxtral, ...) in ``decoder_only.py``; the encoder-decoder families in ``whisper.py`` and
``moonshine.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dflash_hf.targets.families.base import DecoderStreams, TargetFamily, audio_token_id
from dflash_hf.targets.families.decoder_only import (
    AudioFlamingo3Family,
    GLMASRFamily,
    GraniteSpeechFamily,
    Qwen2AudioFamily,
    Qwen2AudioSinglePlaceholderFamily,
    Qwen3ASRFamily,
    TextFamily,
    VoxtralFamily,
)
from dflash_hf.targets.families.moonshine import MoonshineFamily
from dflash_hf.targets.families.whisper import WhisperFamily

# Every family, in the order `supported_families` lists them; a model_type listed by two families resolves to the
# first (`qwen2_audio`: the processor-side expansion).
FAMILY_CLASSES: tuple[type[TargetFamily], ...] = (
    Qwen3ASRFamily,
    TextFamily,
    Qwen2AudioFamily,
    Qwen2AudioSinglePlaceholderFamily,
    VoxtralFamily,
    AudioFlamingo3Family,
    GLMASRFamily,
    GraniteSpeechFamily,
    WhisperFamily,
    MoonshineFamily,
)
FAMILIES: dict[str, TargetFamily] = {cls.name: cls() for cls in FAMILY_CLASSES}

# the family chosen when only the model_type is known: the first one listing it
_DEFAULT_FOR_MODEL_TYPE = {t: f.name for f in reversed(list(FAMILIES.values())) for t in f.model_types}


def supported_families() -> str:
    return ", ".join(f"{f.name} ({', '.join(f.model_types) or 'any causal LM'})" for f in FAMILIES.values())


def resolve_family(config, name: str | None = None) -> TargetFamily:
    """The family of a target config; ``name`` picks one explicitly (e.g. ``"qwen2_audio_single_placeholder"``) and
    must match the config's ``model_type``.

    Configs with no audio family resolve to ``"text"`` only if they are plain decoder LMs (no ``audio_config``)."""
    model_type = getattr(config, "model_type", None)
    if name is not None:
        if name not in FAMILIES:
            raise ValueError(f"unknown target family {name!r}; supported: {supported_families()}")
        family = FAMILIES[name]
        if family.model_types and model_type not in family.model_types:
            raise ValueError(
                f"target family {name!r} expects model_type in {family.model_types}, the config has "
                f"{model_type!r}; drop the family override or pick one of: {supported_families()}"
            )
        if not family.model_types and _looks_multimodal(config):
            raise ValueError(f"family 'text' chosen for a multimodal config (model_type={model_type!r})")
        return family
    if model_type in _DEFAULT_FOR_MODEL_TYPE:
        return FAMILIES[_DEFAULT_FOR_MODEL_TYPE[model_type]]
    if _looks_multimodal(config):
        raise ValueError(
            f"unsupported target model_type {model_type!r} (it has audio/vision sub-configs); "
            f"supported families: {supported_families()}"
        )
    return FAMILIES["text"]


def _looks_multimodal(config) -> bool:
    return any(getattr(config, k, None) is not None for k in ("audio_config", "encoder_config", "vision_config"))


def encode_batch(
    family: TargetFamily,
    processor,
    config,
    texts: Sequence[str],
    audios: Sequence[np.ndarray],
    padding_side: str = "right",
) -> dict:
    """Call the family's processor on rendered conversations (``texts``, with unexpanded audio items as the
    chat template renders them) and their audio arrays (mono float32 at ``family.sampling_rate``, in order of
    appearance). Returns ``input_ids``, ``attention_mask`` and the family's audio kwargs."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    return family.encode(processor, config, texts, audios, padding_side)


def decoder_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Decoder positions counted over real tokens (`[b, S]`): left padding keeps the positions of right padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def decoder_stream_kwargs(inputs: dict, *, position_ids: bool = False, encoder_mask_key: str | None = None) -> dict:
    """Encoder-decoder targets take the batch's token stream as the decoder's: ``input_ids`` / ``attention_mask``
    become ``decoder_input_ids`` / ``decoder_attention_mask``; with ``position_ids`` (a forward, not ``generate``)
    also ``decoder_position_ids`` counted over real tokens, so left padding keeps the positions of right padding.
    Audio kwargs (``input_features``) are kept; the encoder's padding mask (the row's ``encoder_mask_key``)
    becomes ``attention_mask``."""
    out = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", encoder_mask_key)}
    if encoder_mask_key is not None and encoder_mask_key in inputs:
        out["attention_mask"] = inputs[encoder_mask_key]
    if "input_ids" in inputs:
        out["decoder_input_ids"] = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    if mask is not None:
        out["decoder_attention_mask"] = mask
        if position_ids:
            out.setdefault("decoder_position_ids", decoder_positions(mask))
    return out


def generate_kwargs(family: TargetFamily, inputs: dict) -> dict:
    """Keywords of the target's ``generate`` (and of ``speculative_generate``) for prompts as :func:`encode_batch`
    returns them: the decoder's keywords for encoder-decoder families (:func:`decoder_stream_kwargs`), else
    unchanged."""
    if not family.is_encoder_decoder:
        return dict(inputs)
    return decoder_stream_kwargs(inputs, encoder_mask_key=family.encoder_mask_key)


# ------------------------------------------------------------------------------------------ decoder streams


def decoder_streams(family: TargetFamily, target_model, batch: dict) -> DecoderStreams:
    """Streams aligned 1:1 with the decoder positions after audio expansion.

    Processor-side and encoder-decoder families: identity, ``audio_mask = input_ids == audio_token_id`` (none
    for encoder-decoder families), ``position_ids`` None
    (the decoder uses ``arange(S)``). Model-side single placeholder: each placeholder becomes ``n_frames``
    positions marked audio and never supervised, rows are re-padded exactly as the model's merge does, and
    ``position_ids`` are the ones the model passes to its decoder."""
    input_ids = batch["input_ids"]
    attention_mask = batch["attention_mask"]
    loss_mask = batch["loss_mask"].bool()
    config = target_model.config
    audio_id = audio_token_id(family, config)
    if family.expansion != "model":
        audio_mask = (input_ids == audio_id) if audio_id is not None else torch.zeros_like(loss_mask)
        return DecoderStreams(input_ids, attention_mask, loss_mask & ~audio_mask, audio_mask, None)
    return _expand_single_placeholder(target_model, batch, audio_id)


def _expand_single_placeholder(target_model, batch: dict, audio_id: int) -> DecoderStreams:
    """Port of Qwen2-Audio's ``_merge_input_ids_with_audio_features`` on ids/masks (no embeddings)."""
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    loss_mask = batch["loss_mask"].bool()
    inner = target_model.model
    _, n_frames = inner.audio_tower._get_feat_extract_output_lengths(batch["feature_attention_mask"].sum(-1))
    n_frames = n_frames.to(input_ids.device).long()
    b, _ = input_ids.shape
    is_audio = input_ids == audio_id
    if int(is_audio.sum()) != n_frames.numel():
        raise ValueError(f"{int(is_audio.sum())} audio placeholders in input_ids but {n_frames.numel()} audios")
    left_any = bool((attention_mask[:, 0] == 0).any())
    right_any = bool((attention_mask[:, -1] == 0).any())
    left_padding = True
    if b > 1:
        if left_any and right_any:
            raise ValueError("attention_mask has padding on both sides; the model-side merge refuses it")
        left_padding = left_any or (not right_any and inner.padding_side == "left")

    reps = torch.ones_like(input_ids)
    reps[is_audio] = n_frames
    new_pos = reps.cumsum(-1) - 1
    total = int(reps.sum(-1).max())
    if left_padding:
        new_pos = new_pos + (total - 1 - new_pos[:, -1])[:, None]
    text = (~is_audio) & (attention_mask == 1)
    rows, cols = torch.where(text)
    dest = new_pos[rows, cols]

    pad_id = target_model.config.text_config.pad_token_id
    pad_id = 0 if pad_id is None else pad_id
    out_ids = torch.full((b, total), pad_id, dtype=input_ids.dtype)
    out_attn = torch.zeros((b, total), dtype=attention_mask.dtype)
    out_loss = torch.zeros((b, total), dtype=torch.bool)
    out_ids[rows, dest] = input_ids[rows, cols]
    out_attn[rows, dest] = attention_mask[rows, cols]
    out_loss[rows, dest] = loss_mask[rows, cols]

    audio = torch.ones((b, total), dtype=torch.bool)
    audio[rows, dest] = False
    seq = torch.arange(total)[None, :]
    real_len = (reps.sum(-1) - (attention_mask == 0).long().sum(-1))[:, None]
    audio &= ((total - seq) <= real_len) if left_padding else (seq < real_len)
    out_ids[audio] = audio_id
    out_attn[audio] = 1
    position_ids = (out_attn.cumsum(-1) - 1).masked_fill(out_attn == 0, 1)
    return DecoderStreams(out_ids, out_attn, out_loss, audio, position_ids)


__all__ = [
    "FAMILIES",
    "FAMILY_CLASSES",
    "decoder_positions",
    "decoder_stream_kwargs",
    "decoder_streams",
    "encode_batch",
    "generate_kwargs",
    "resolve_family",
    "supported_families",
]
