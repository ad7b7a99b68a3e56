"""Target families: one table row per audio-LLM family.

A row says how to find the audio placeholder id in the target's config, how to call the family's processor
for a batch (audio kwargs names, sampling rate, fixed chunks), whether audio placeholders are expanded by the
processor (one placeholder per encoder frame, as Qwen3-ASR) or by the model (one placeholder per audio,
replaced inside the model by a variable number of frames, as NeMo SALM / legacy Qwen2-Audio), and how many
decoder positions one audio of ``n`` samples occupies (for token budgets). Encoder-decoder rows (Whisper,
``expansion == "encoder"``) put no audio in the decoder stream: the audio reaches the decoder through
cross-attention, and the family renders the decoder's own prompt instead of a chat template.

:func:`decoder_streams` turns a collated batch into streams aligned 1:1 with the decoder's positions
after audio expansion (see docs/ARCHITECTURE.md, "Decoder streams"). The row type and the helpers rows share are
in ``families_base.py``; the Whisper row in ``families_whisper.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from dflash_hf.targets.families.base import (
    HOP_LENGTH,
    SAMPLING_RATE,
    DecoderStreams,
    TargetFamily,
    _add_special_tokens,
    _mel_frames,
    _select,
    audio_token_id,
    get_tokenizer,
    tokenize_padded,
)
from dflash_hf.targets.families.moonshine import MOONSHINE
from dflash_hf.targets.families.qwen3_asr import forward_inputs as qwen3_asr_forward_inputs
from dflash_hf.targets.families.qwen3_asr import host_facts as qwen3_asr_host_facts
from dflash_hf.targets.families.whisper import WHISPER

# ---------------------------------------------------------------------------------------------- encoders


def _encode_processor(family, processor, config, texts, audios, padding_side):
    """Processor-side expansion: the processor returns ids with one placeholder per encoder frame."""
    tokenizer = get_tokenizer(processor)
    # text-only kwargs: a top-level `padding` would also change the audio padding of some processors
    text_kwargs = dict(
        padding=True, padding_side=padding_side, add_special_tokens=_add_special_tokens(tokenizer, texts)
    )
    out = processor(
        text=list(texts),
        audio=list(audios),
        sampling_rate=family.sampling_rate,
        return_tensors="pt",
        text_kwargs=text_kwargs,
    )
    return _select(out, ("input_ids", "attention_mask", *family.audio_kwargs))


def _encode_text(family, processor, config, texts, audios, padding_side):
    if audios:
        raise ValueError(f"family {family.name!r} is text-only but the batch has {len(audios)} audios")
    tokenizer = get_tokenizer(processor)
    return tokenize_padded(tokenizer, texts, padding_side, _add_special_tokens(tokenizer, texts))


def _encode_single_placeholder(family, processor, config, texts, audios, padding_side):
    """Model-side expansion (legacy Qwen2-Audio / NeMo SALM layout): ids keep one placeholder per audio;
    features padded to 30 s with a ``feature_attention_mask``; the model inserts the frames."""
    tokenizer = get_tokenizer(processor)
    placeholder = tokenizer.convert_ids_to_tokens(audio_token_id(family, config))
    counts = [t.count(placeholder) for t in texts]
    if sum(counts) != len(audios):
        raise ValueError(f"{sum(counts)} {placeholder} placeholders in the texts but {len(audios)} audios")
    out = tokenize_padded(tokenizer, texts, padding_side, _add_special_tokens(tokenizer, texts))
    feats = processor.feature_extractor(
        list(audios),
        sampling_rate=family.sampling_rate,
        padding="max_length",
        return_attention_mask=True,
        return_tensors="pt",
    )
    return {
        "input_ids": out["input_ids"],
        "attention_mask": out["attention_mask"],
        "input_features": feats["input_features"],
        "feature_attention_mask": feats["attention_mask"],
    }


def _encode_voxtral(family, processor, config, texts, audios, padding_side):
    """Voxtral: every audio is padded to a multiple of 30 s and cut into 30 s chunks of mel features
    (``[n_chunks, mel, 3000]``, as ``VoxtralProcessor._retrieve_input_features``); each chunk becomes a fixed
    number of audio tokens, inserted here in place of the audio's single placeholder (what mistral-common's
    tokenizer does for the real processor)."""
    tokenizer = get_tokenizer(processor)
    placeholder = tokenizer.convert_ids_to_tokens(audio_token_id(family, config))
    chunk_samples = int(family.chunk_seconds * family.sampling_rate)
    per_chunk = _voxtral_tokens_per_chunk(config)
    chunk_frames = chunk_samples // HOP_LENGTH
    queue = list(audios)
    expanded, features = [], []
    for text in texts:
        pieces = text.split(placeholder)
        out = pieces[0]
        for piece in pieces[1:]:
            if not queue:
                raise ValueError(f"more {placeholder} placeholders in the texts than audios ({len(audios)})")
            audio = queue.pop(0)
            n_chunks = max(1, -(-len(audio) // chunk_samples))
            feats = processor.feature_extractor(
                audio,
                sampling_rate=family.sampling_rate,
                padding=True,
                truncation=False,
                pad_to_multiple_of=chunk_samples,
                return_tensors="pt",
            )["input_features"]
            mel = feats.shape[1]
            features.append(feats.reshape(mel, -1, chunk_frames).transpose(0, 1))
            if features[-1].shape[0] != n_chunks:
                raise RuntimeError(
                    f"voxtral: expected {n_chunks} chunks, feature extractor made {features[-1].shape[0]}"
                )
            out += placeholder * (n_chunks * per_chunk) + piece
        expanded.append(out)
    if queue:
        raise ValueError(f"{len(queue)} audios left without a {placeholder} placeholder in the texts")
    result = tokenize_padded(tokenizer, expanded, padding_side, _add_special_tokens(tokenizer, expanded))
    if features:
        result["input_features"] = torch.cat(features)
    return result


# ------------------------------------------------------------------------------------- audio token counts


def _qwen3_asr_tokens(config, n: int) -> int:
    frames = max(n, 8000) // HOP_LENGTH  # the feature extractor zero-pads clips shorter than 0.5 s
    n_window = getattr(getattr(config, "audio_config", None), "n_window", 50)
    chunk = 2 * n_window
    rem = frames % chunk
    f = (rem - 1) // 2 + 1
    p = (f - 1) // 2 + 1
    return (p - 1) // 2 + 1 + (frames // chunk) * 13


def _qwen2_audio_tokens(config, n: int) -> int:
    frames = min(_mel_frames(n), 3000)  # padded / truncated to 30 s
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def _windowed_frames(n: int, window_seconds: float = 30.0) -> int:
    window = int(window_seconds * SAMPLING_RATE)
    n_win = max(1, -(-n // window))
    return sum(_mel_frames(min(window, n - i * window)) for i in range(n_win))


def _audioflamingo3_tokens(config, n: int) -> int:
    conv = (_windowed_frames(n) - 1) // 2 + 1
    return (conv - 2) // 2 + 1


def _glmasr_tokens(config, n: int) -> int:
    a = (_windowed_frames(n) - 1) // 2 + 1
    return (a - 4) // 4 + 1


def _voxtral_tokens_per_chunk(config) -> int:
    ac = config.audio_config
    return ac.max_source_positions * ac.hidden_size // ac.intermediate_size


def _voxtral_tokens(config, n: int) -> int:
    return max(1, -(-n // (30 * SAMPLING_RATE))) * _voxtral_tokens_per_chunk(config)


def _granite_speech_tokens(config, n: int) -> int:
    encoder_length = (n // HOP_LENGTH + 1) // 2
    return math.ceil(encoder_length / config.window_size) * (config.window_size // config.downsample_rate)


# ------------------------------------------------------------------------------------------------ the table

FAMILIES: dict[str, TargetFamily] = {
    f.name: f
    for f in (
        TargetFamily(
            name="qwen3_asr",
            model_types=("qwen3_asr",),
            expansion="processor",
            audio_kwargs=("input_features", "input_features_mask"),
            encode=_encode_processor,
            audio_tokens=_qwen3_asr_tokens,
            prebuilt_packed_mask=True,
            host_facts=qwen3_asr_host_facts,
            forward_inputs=qwen3_asr_forward_inputs,
            description="Qwen3-ASR: processor expands <|audio_pad|> to one token per encoder frame",
        ),
        TargetFamily(
            name="text",
            model_types=(),
            expansion="none",
            audio_kwargs=(),
            encode=_encode_text,
            render_with="tokenizer",
            prebuilt_packed_mask=True,
            prebuilt_padded_mask=True,
            graph_capturable=True,
            description="plain causal LM (any AutoModelForCausalLM)",
        ),
        TargetFamily(
            name="qwen2_audio",
            model_types=("qwen2_audio",),
            expansion="processor",
            audio_kwargs=("input_features", "feature_attention_mask"),
            encode=_encode_processor,
            audio_tokens=_qwen2_audio_tokens,
            description="Qwen2-Audio: processor expands <|AUDIO|>, features padded to 30 s",
        ),
        TargetFamily(
            name="qwen2_audio_single_placeholder",
            model_types=("qwen2_audio",),
            expansion="model",
            audio_kwargs=("input_features", "feature_attention_mask"),
            encode=_encode_single_placeholder,
            audio_tokens=_qwen2_audio_tokens,
            description="model-side single placeholder per audio (NeMo SALM layout; legacy Qwen2-Audio merge)",
        ),
        TargetFamily(
            name="voxtral",
            model_types=("voxtral",),
            expansion="processor",
            audio_kwargs=("input_features",),
            encode=_encode_voxtral,
            audio_tokens=_voxtral_tokens,
            render_with="tokenizer",
            chunk_seconds=30.0,
            description="Voxtral: fixed 30 s chunks, a fixed number of audio tokens per chunk",
        ),
        TargetFamily(
            name="audioflamingo3",
            model_types=("audioflamingo3",),
            expansion="processor",
            audio_kwargs=("input_features", "input_features_mask"),
            encode=_encode_processor,
            audio_tokens=_audioflamingo3_tokens,
            description="AudioFlamingo3: 30 s windows, processor expands the audio token",
        ),
        TargetFamily(
            name="glmasr",
            model_types=("glmasr",),
            expansion="processor",
            audio_kwargs=("input_features", "input_features_mask"),
            encode=_encode_processor,
            audio_tokens=_glmasr_tokens,
            description="GLM-ASR: 30 s windows, processor expands the audio token",
        ),
        TargetFamily(
            name="granite_speech",
            model_types=("granite_speech",),
            expansion="processor",
            audio_kwargs=("input_features", "input_features_mask"),
            encode=_encode_processor,
            audio_tokens=_granite_speech_tokens,
            description="Granite Speech: processor expands <|audio|> (feature extractor needs torchaudio)",
        ),
        WHISPER,
        MOONSHINE,
    )
}

# the row chosen when only the model_type is known: the first row listing it
_DEFAULT_FOR_MODEL_TYPE = {t: f.name for f in reversed(list(FAMILIES.values())) for t in f.model_types}


def supported_families() -> str:
    return ", ".join(f"{f.name} ({', '.join(f.model_types) or 'any causal LM'})" for f in FAMILIES.values())


def resolve_family(config, name: str | None = None) -> TargetFamily:
    """The family row for a target config; ``name`` picks a row explicitly (e.g.
    ``"qwen2_audio_single_placeholder"``) and must match the config's ``model_type``.

    Configs with no audio row resolve to ``"text"`` only if they are plain decoder LMs (no ``audio_config``)."""
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
    return family.encode(family, processor, config, texts, audios, padding_side)


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
