"""The decoder-only families: a text LLM, and audio LLMs whose audio sits in the decoder's token stream.

Each family says how to find the audio placeholder id in the target's config, how to call its processor for a batch
(audio kwargs names, sampling rate, fixed chunks), whether audio placeholders are expanded by the processor (one
placeholder per encoder frame, as Qwen3-ASR) or by the model (one placeholder per audio, replaced inside the model by
a variable number of frames, as NeMo SALM / legacy Qwen2-Audio), and how many decoder positions one audio of ``n``
samples occupies (for token budgets). The encoder-decoder families are in ``whisper.py`` and ``moonshine.py``.
"""

from __future__ import annotations

import math

import torch

from dflash_hf.targets.families import qwen3_asr
from dflash_hf.targets.families.base import (
    HOP_LENGTH,
    SAMPLING_RATE,
    TargetFamily,
    audio_token_id,
    get_tokenizer,
    mel_frames,
    select_outputs,
    should_add_special_tokens,
    tokenize_padded,
)

# ---------------------------------------------------------------------------------------------- encoders


def _encode_processor(family, processor, config, texts, audios, padding_side):
    """Processor-side expansion: the processor returns ids with one placeholder per encoder frame."""
    tokenizer = get_tokenizer(processor)
    # text-only kwargs: a top-level `padding` would also change the audio padding of some processors
    text_kwargs = dict(
        padding=True, padding_side=padding_side, add_special_tokens=should_add_special_tokens(tokenizer, texts)
    )
    out = processor(
        text=list(texts),
        audio=list(audios),
        sampling_rate=family.sampling_rate,
        return_tensors="pt",
        text_kwargs=text_kwargs,
    )
    return select_outputs(out, ("input_ids", "attention_mask", *family.audio_kwargs))


def _encode_text(family, processor, config, texts, audios, padding_side):
    if audios:
        raise ValueError(f"family {family.name!r} is text-only but the batch has {len(audios)} audios")
    tokenizer = get_tokenizer(processor)
    return tokenize_padded(tokenizer, texts, padding_side, should_add_special_tokens(tokenizer, texts))


def _encode_single_placeholder(family, processor, config, texts, audios, padding_side):
    """Model-side expansion (legacy Qwen2-Audio / NeMo SALM layout): ids keep one placeholder per audio;
    features padded to 30 s with a ``feature_attention_mask``; the model inserts the frames."""
    tokenizer = get_tokenizer(processor)
    placeholder = tokenizer.convert_ids_to_tokens(audio_token_id(family, config))
    counts = [t.count(placeholder) for t in texts]
    if sum(counts) != len(audios):
        raise ValueError(f"{sum(counts)} {placeholder} placeholders in the texts but {len(audios)} audios")
    out = tokenize_padded(tokenizer, texts, padding_side, should_add_special_tokens(tokenizer, texts))
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
    result = tokenize_padded(tokenizer, expanded, padding_side, should_add_special_tokens(tokenizer, expanded))
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
    frames = min(mel_frames(n), 3000)  # padded / truncated to 30 s
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def _windowed_frames(n: int, window_seconds: float = 30.0) -> int:
    window = int(window_seconds * SAMPLING_RATE)
    n_win = max(1, -(-n // window))
    return sum(mel_frames(min(window, n - i * window)) for i in range(n_win))


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


# ------------------------------------------------------------------------------------------------ the families


class ProcessorExpandedFamily(TargetFamily):
    """Audio placeholders expanded by the processor: one placeholder per encoder frame."""

    expansion = "processor"
    audio_kwargs = ("input_features", "input_features_mask")
    encode = _encode_processor


class Qwen3ASRFamily(ProcessorExpandedFamily):
    """Qwen3-ASR: processor expands <|audio_pad|> to one token per encoder frame."""

    name = "qwen3_asr"
    model_types = ("qwen3_asr",)
    audio_tokens = staticmethod(_qwen3_asr_tokens)
    prebuilt_packed_mask = True
    host_facts = staticmethod(qwen3_asr.host_facts)
    forward_inputs = staticmethod(qwen3_asr.forward_inputs)


class TextFamily(TargetFamily):
    """Plain causal LM (any AutoModelForCausalLM)."""

    name = "text"
    expansion = "none"
    encode = _encode_text
    render_with = "tokenizer"
    prebuilt_packed_mask = True
    prebuilt_padded_mask = True
    graph_capturable = True


class Qwen2AudioFamily(ProcessorExpandedFamily):
    """Qwen2-Audio: processor expands <|AUDIO|>, features padded to 30 s."""

    name = "qwen2_audio"
    model_types = ("qwen2_audio",)
    audio_kwargs = ("input_features", "feature_attention_mask")
    audio_tokens = staticmethod(_qwen2_audio_tokens)


class Qwen2AudioSinglePlaceholderFamily(TargetFamily):
    """Model-side single placeholder per audio (NeMo SALM layout; legacy Qwen2-Audio merge)."""

    name = "qwen2_audio_single_placeholder"
    model_types = ("qwen2_audio",)
    expansion = "model"
    audio_kwargs = ("input_features", "feature_attention_mask")
    encode = _encode_single_placeholder
    audio_tokens = staticmethod(_qwen2_audio_tokens)


class VoxtralFamily(TargetFamily):
    """Voxtral: fixed 30 s chunks, a fixed number of audio tokens per chunk."""

    name = "voxtral"
    model_types = ("voxtral",)
    expansion = "processor"
    audio_kwargs = ("input_features",)
    encode = _encode_voxtral
    audio_tokens = staticmethod(_voxtral_tokens)
    render_with = "tokenizer"
    chunk_seconds = 30.0


class AudioFlamingo3Family(ProcessorExpandedFamily):
    """AudioFlamingo3: 30 s windows, processor expands the audio token."""

    name = "audioflamingo3"
    model_types = ("audioflamingo3",)
    audio_tokens = staticmethod(_audioflamingo3_tokens)


class GLMASRFamily(ProcessorExpandedFamily):
    """GLM-ASR: 30 s windows, processor expands the audio token."""

    name = "glmasr"
    model_types = ("glmasr",)
    audio_tokens = staticmethod(_glmasr_tokens)


class GraniteSpeechFamily(ProcessorExpandedFamily):
    """Granite Speech: processor expands <|audio|> (feature extractor needs torchaudio)."""

    name = "granite_speech"
    model_types = ("granite_speech",)
    audio_tokens = staticmethod(_granite_speech_tokens)


__all__ = [
    "AudioFlamingo3Family",
    "GLMASRFamily",
    "GraniteSpeechFamily",
    "ProcessorExpandedFamily",
    "Qwen2AudioFamily",
    "Qwen2AudioSinglePlaceholderFamily",
    "Qwen3ASRFamily",
    "TextFamily",
    "VoxtralFamily",
]
