"""The Moonshine family: a second encoder-decoder speech model through the same kind of family as Whisper
(`EncoderDecoderFamily`). Moonshine's encoder reads the raw 16 kHz waveform (``input_values``, padded per batch,
with its padding mask), not a fixed 30 s window of log-mel features; its decoder starts from
``decoder_start_token_id`` and ends with the end token, with no language or task prompt."""

from __future__ import annotations

from dflash_hf.targets.families.base import SAMPLING_RATE, EncoderDecoderFamily, get_tokenizer

ENCODER_MASK_KEY = "input_values_mask"  # the batch key; the model's forward takes it as `attention_mask`


def _stream_ids(tokenizer, text: str) -> list[int]:
    """Ids of one rendered decoder stream: the start token, the transcript tokenized on its own, the end token
    if the stream has one. A SentencePiece tokenizer (Moonshine's) marks a word start with "▁" only at the start
    of a piece of text, so the transcript tokenized after the start token in one string could lose the "▁" of its
    first word: tokenized alone, it gets the ids the model decodes for it."""
    start, end = _start_token(tokenizer), tokenizer.eos_token
    if not text.startswith(start):
        raise ValueError(f"a Moonshine decoder stream starts with {start!r}; got {text[:40]!r}")
    body = text[len(start) :]
    ended = body.endswith(end)
    body = body[: -len(end)] if ended else body
    ids = tokenizer(body, add_special_tokens=False)["input_ids"] if body else []
    return [tokenizer.convert_tokens_to_ids(start), *ids, *([tokenizer.eos_token_id] if ended else [])]


def _encode_moonshine(family, processor, config, texts, audios, padding_side):
    """``texts`` are rendered decoder streams (start token, transcript, end token), padded on ``padding_side``;
    one waveform per text, right-padded to the longest with its padding mask."""
    if len(audios) != len(texts):
        raise ValueError(f"family {family.name!r}: {len(texts)} texts but {len(audios)} audios (one audio each)")
    tokenizer = get_tokenizer(processor)
    out = tokenizer.pad(
        {"input_ids": [_stream_ids(tokenizer, t) for t in texts]},
        padding=True,
        padding_side=padding_side,
        return_tensors="pt",
    )
    audio = processor.feature_extractor(
        list(audios), sampling_rate=family.sampling_rate, padding=True, return_attention_mask=True, return_tensors="pt"
    )
    return {
        "input_ids": out["input_ids"],
        "attention_mask": out["attention_mask"],
        "input_values": audio["input_values"],
        ENCODER_MASK_KEY: audio["attention_mask"].long(),
    }


def _start_token(tokenizer) -> str:
    token = getattr(tokenizer, "bos_token", None)
    if not token:
        raise ValueError(
            "the Moonshine tokenizer has no bos_token: the decoder's start token (the config's "
            "decoder_start_token_id) must be the tokenizer's bos_token; set tokenizer.bos_token"
        )
    return token


def _render_moonshine(tokenizer, messages: list[dict], add_generation_prompt: bool = False, **_) -> str:
    """The decoder stream of a conversation from ``cut_to_messages``: the start token (what ``generate`` starts
    from), then for a full conversation the transcript and the end token. Moonshine has no prompt: a system
    prompt or user text (a manifest ``context``) is refused rather than dropped."""
    if any(m["role"] == "system" for m in messages):
        raise ValueError(
            "field 'system_prompt': Moonshine has no system turn; remove the system prompt (the "
            "configured one or the sample's field)"
        )
    user = [i for m in messages if m["role"] == "user" for i in m["content"]]
    if sum(i.get("type") == "audio" for i in user) != 1:
        raise ValueError("a Moonshine sample has exactly one audio")
    if any(i.get("type") == "text" and i["text"].strip() for i in user):
        raise ValueError(
            "field 'context' (or --prompt): Moonshine's decoder takes no prompt text; drop the user "
            "text for this target"
        )
    prompt = _start_token(tokenizer)
    answer = [m for m in messages if m["role"] == "assistant"]
    if not answer or add_generation_prompt:
        return prompt
    text = "".join(i["text"] for i in answer[0]["content"] if i.get("type") == "text")
    return f"{prompt}{text}{tokenizer.eos_token}"  # surrounding whitespace is a bad sample (_moonshine_sample_problem)


def _moonshine_decoder_config(config):
    """The decoder's dimensions under the usual names (MoonshineConfig keeps encoder and decoder counts apart)."""
    from transformers import PretrainedConfig

    return PretrainedConfig(
        hidden_size=config.hidden_size,
        num_hidden_layers=config.decoder_num_hidden_layers,
        num_attention_heads=config.decoder_num_attention_heads,
        num_key_value_heads=config.decoder_num_key_value_heads,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        hidden_act="silu",
        pad_token_id=config.pad_token_id,
        eos_token_id=config.eos_token_id,
    )


def _encoder_frames(num_samples: int) -> int:
    """Encoder frames of a waveform of ``num_samples`` (Moonshine's own formula: its three strided convolutions)."""
    from transformers.models.moonshine.modeling_moonshine import MoonshinePreTrainedModel

    return MoonshinePreTrainedModel._get_feat_extract_output_lengths(None, num_samples)


def _moonshine_sample_problem(config, tokenizer, cut):
    start = tokenizer.convert_tokens_to_ids(_start_token(tokenizer))
    if start != config.decoder_start_token_id:
        return (
            "decoder_start_token_id",
            f"the tokenizer's bos_token has id {start}, the config's "
            f"decoder_start_token_id is {config.decoder_start_token_id}",
            "use the checkpoint's own tokenizer (its bos_token starts the decoder)",
        )
    eos = config.eos_token_id if isinstance(config.eos_token_id, (list, tuple)) else [config.eos_token_id]
    if tokenizer.eos_token_id not in eos:
        return (
            "eos_token_id",
            f"the tokenizer's eos_token has id {tokenizer.eos_token_id}, the config's "
            f"eos_token_id is {config.eos_token_id}",
            "use the checkpoint's own tokenizer",
        )
    text = cut.supervisions[0].text
    if isinstance(text, str) and text != text.strip():
        return (
            "text",
            "the transcript starts or ends with whitespace, which Moonshine's decoder never writes",
            "strip the transcripts in the manifest",
        )
    num_samples = round(cut.duration * SAMPLING_RATE)
    if _encoder_frames(num_samples) < 1:
        return (
            "duration",
            f"the audio lasts {cut.duration:.3f} s, too short for one Moonshine encoder frame",
            "drop clips this short (or pad them with silence in the manifest's audio)",
        )
    return None


def _moonshine_per_utterance_encoder(model, kwargs: dict) -> dict:
    """Forward kwargs with the encoder run on each utterance alone. Moonshine's encoder normalizes over time
    (GroupNorm of one group after the first convolution) including the padding, so a clip padded in a batch gets
    other frames than the same clip decoded alone (batch 1, no padding); training on those would teach the draft
    features it never sees. Each row's waveform is cut to its mask, encoded, and the frames padded back with a
    frame mask (the decoder's cross-attention ignores the padded frames)."""
    import torch
    from torch.nn.functional import pad

    if "input_values" not in kwargs or kwargs.get("encoder_outputs") is not None:
        return kwargs
    values, mask = kwargs.pop("input_values"), kwargs.pop("attention_mask", None)
    encoder = model.get_encoder()
    lengths = mask.sum(-1).tolist() if mask is not None else [values.shape[-1]] * values.shape[0]
    with torch.no_grad():
        outputs = [encoder(values[i : i + 1, : int(n)]) for i, n in enumerate(lengths)]
    frames = [o.last_hidden_state[0] for o in outputs]
    width = max(f.shape[0] for f in frames)
    hidden = torch.stack([pad(f, (0, 0, 0, width - f.shape[0])) for f in frames])
    frame_mask = torch.stack([torch.arange(width, device=hidden.device) < f.shape[0] for f in frames]).int()
    # the encoder's own output class: the decoder reads the frame mask from its `attention_mask`
    kwargs["encoder_outputs"] = type(outputs[0])(last_hidden_state=hidden, attention_mask=frame_mask)
    return kwargs


class MoonshineFamily(EncoderDecoderFamily):
    """Moonshine (encoder-decoder, raw waveform): the start token is context, the transcript is supervised."""

    name = "moonshine"
    model_types = ("moonshine",)
    audio_kwargs = ("input_values", ENCODER_MASK_KEY)
    encode = _encode_moonshine
    render_decoder = staticmethod(_render_moonshine)
    decoder_config = staticmethod(_moonshine_decoder_config)
    sample_problem = staticmethod(_moonshine_sample_problem)
    encoder_mask_key = ENCODER_MASK_KEY
    prepare_forward = staticmethod(_moonshine_per_utterance_encoder)
    stream_ids = staticmethod(_stream_ids)

    @staticmethod
    def max_positions(config) -> int:
        return config.max_position_embeddings
