"""The Whisper family (encoder-decoder): the audio reaches the decoder through cross-attention, so the decoder stream
holds no audio; the family renders the decoder's own prompt instead of a chat template, sizes the draft from the
decoder's dimensions and checks each sample's language and length."""

from __future__ import annotations

from dflash_hf.targets.families.base import (
    HOP_LENGTH,
    SAMPLING_RATE,
    EncoderDecoderFamily,
    get_tokenizer,
    tokenize_padded,
)
from dflash_hf.targets.families.whisper_features import AUDIO_WAVES_KEY, COMPACT_FEATURES_KEY


def _encode_encoder_decoder(family, processor, config, texts, audios, padding_side):
    """Encoder-decoder (Whisper): ``texts`` are rendered decoder streams (prompt, transcript, end token),
    tokenized as they are; one audio per text, as features of one encoder window."""
    if len(audios) != len(texts):
        raise ValueError(f"family {family.name!r}: {len(texts)} texts but {len(audios)} audios (one audio each)")
    tokenizer = get_tokenizer(processor)
    features = processor.feature_extractor(list(audios), sampling_rate=family.sampling_rate, return_tensors="pt")
    # waves or compact features where the collator's extractor makes them (`window_frames`), else the whole window
    key = next(k for k in (AUDIO_WAVES_KEY, COMPACT_FEATURES_KEY, "input_features") if k in features)
    return {**tokenize_padded(tokenizer, texts, padding_side, add_special_tokens=False), key: features[key]}


WHISPER_DEFAULT_LANGUAGE = "en"


def _whisper_language_token(tokenizer, language: str | None) -> str | None:
    """``<|xx|>`` for a manifest ``lang`` (``"en"``, ``"english"`` or ``"<|en|>"``; default English), or None when
    the tokenizer has no such language token."""
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    code = (language or WHISPER_DEFAULT_LANGUAGE).strip().lower()
    code = TO_LANGUAGE_CODE.get(code, code).strip("<|>")
    token = f"<|{code}|>"
    return None if tokenizer.convert_tokens_to_ids(token) in (None, tokenizer.unk_token_id) else token


def _render_whisper(tokenizer, messages: list[dict], add_generation_prompt: bool = False, **_) -> str:
    """Whisper's decoder stream for a conversation from ``cut_to_messages``: the user's text, if any, as Whisper's
    previous-text prompt (``<|startofprev|>`` + a space + the text, as ``WhisperTokenizer.get_prompt_ids``
    writes it), then ``<|startoftranscript|><|lang|><|transcribe|><|notimestamps|>``, then (for a full
    conversation) a space, the transcript and ``<|endoftext|>`` (the space as Whisper itself writes it before
    the first word). ``lang`` comes from the audio item's ``language`` (the manifest's ``lang``), default
    English. Everything before the transcript is context, never supervised."""
    if any(m["role"] == "system" for m in messages):
        raise ValueError(
            "field 'system_prompt': Whisper has no system turn; remove the system prompt (the "
            "configured one or the sample's field), or give previous text as the 'context' field"
        )
    user = [i for m in messages if m["role"] == "user" for i in m["content"]]
    audio = [i for i in user if i.get("type") == "audio"]
    if len(audio) != 1:
        raise ValueError(f"a Whisper sample has exactly one audio, this conversation has {len(audio)}")
    language = _whisper_language_token(tokenizer, audio[0].get("language"))
    if language is None:
        raise ValueError(
            f"field 'lang': {audio[0].get('language')!r} is not a language of this Whisper tokenizer; "
            "use a Whisper language code such as 'en' or 'de'"
        )
    context = " ".join(i["text"].strip() for i in user if i.get("type") == "text" and i["text"].strip())
    previous = f"<|startofprev|> {context}" if context else ""
    prompt = f"{previous}<|startoftranscript|>{language}<|transcribe|><|notimestamps|>"
    answer = [m for m in messages if m["role"] == "assistant"]
    if not answer or add_generation_prompt:
        return prompt
    text = "".join(i["text"] for i in answer[0]["content"] if i.get("type") == "text")
    return f"{prompt} {text.lstrip()}{tokenizer.eos_token}"


def _whisper_decoder_config(config):
    """The Whisper decoder's dimensions under the usual config names (WhisperConfig maps them to the encoder)."""
    from transformers import PretrainedConfig

    return PretrainedConfig(
        hidden_size=config.d_model,
        num_hidden_layers=config.decoder_layers,
        num_attention_heads=config.decoder_attention_heads,
        num_key_value_heads=config.decoder_attention_heads,
        intermediate_size=config.decoder_ffn_dim,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_target_positions,
        hidden_act="silu",
        pad_token_id=config.pad_token_id,
        eos_token_id=config.eos_token_id,
    )


def whisper_window_frames(config) -> int:
    """Mel frames of one encoder window: ``max_source_positions`` after the stride-2 convolution (3000)."""
    return config.max_source_positions * 2


def whisper_max_audio_seconds(config) -> float:
    """One encoder window at the 10 ms mel hop (30 s)."""
    return whisper_window_frames(config) * HOP_LENGTH / SAMPLING_RATE


def _whisper_sample_problem(config, tokenizer, cut):
    language = cut.supervisions[0].language
    if _whisper_language_token(tokenizer, language) is None:
        return (
            "lang",
            f"{language!r} is not a language of this Whisper tokenizer",
            "use a Whisper language code such as 'en' or 'de' (or leave 'lang' out for English)",
        )
    seconds = whisper_max_audio_seconds(config)
    if cut.duration > seconds + 1e-6:
        return (
            "duration",
            f"the audio lasts {cut.duration:.2f} s, longer than Whisper's {seconds:g} s window (the "
            "feature extractor would cut it)",
            f"split the audio into pieces of at most {seconds:g} s",
        )
    return None


class WhisperFamily(EncoderDecoderFamily):
    """Whisper (encoder-decoder): the decoder's prompt is context, the transcript is supervised."""

    name = "whisper"
    model_types = ("whisper",)
    audio_kwargs = ("input_features",)
    encode = _encode_encoder_decoder
    render_decoder = staticmethod(_render_whisper)
    decoder_config = staticmethod(_whisper_decoder_config)
    sample_problem = staticmethod(_whisper_sample_problem)
    prebuilt_padded_mask = True
    graph_capturable = True
    window_frames = staticmethod(whisper_window_frames)

    @staticmethod
    def max_positions(config) -> int:
        return config.max_target_positions
