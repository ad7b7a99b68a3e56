"""What every target family is (`TargetFamily`, the base class with its required and optional hooks;
`EncoderDecoderFamily`), the decoder-aligned streams (`DecoderStreams`) and the helpers families share. The families
themselves are subclasses in `decoder_only.py`, `whisper.py` and `moonshine.py`, listed in `registry.py`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

HOP_LENGTH = 160  # 10 ms mel hop at 16 kHz: every family here uses it
SAMPLING_RATE = 16000


@dataclass
class DecoderStreams:
    """Streams aligned 1:1 with the decoder positions (``[b, S']`` each)."""

    input_ids: torch.LongTensor
    attention_mask: torch.LongTensor
    loss_mask: torch.BoolTensor
    audio_mask: torch.BoolTensor
    position_ids: torch.LongTensor | None


EXPANSIONS = ("processor", "model", "encoder", "none")
RENDERERS = ("processor", "tokenizer")
# The optional hooks that change only speed (a family without them takes the generic path).
FAST_PATH_HOOKS = (
    "prebuilt_packed_mask",
    "prebuilt_padded_mask",
    "graph_capturable",
    "host_facts",
    "forward_inputs",
    "window_frames",
)


class TargetFamily:
    """A target family: how the frozen target's processor is called, where its audio goes and what the rest of the
    package needs to know of it. Each family is a subclass (`registry.FAMILY_CLASSES`, one instance each in
    `registry.FAMILIES`); its docstring says what it is.

    Class attributes every family sets:

    - ``name``: the family name (``resolve_family(config, name=...)`` accepts it).
    - ``model_types``: config ``model_type`` values this family matches (none: any causal LM, the text family).
    - ``expansion``: ``"processor"`` (placeholders expanded by the processor), ``"model"`` (one placeholder
      per audio, expanded inside the model), ``"encoder"`` (encoder-decoder: the audio goes to the encoder, the
      token stream is the decoder's; subclass `EncoderDecoderFamily`) or ``"none"`` (text-only target).
    - ``audio_kwargs``: batch keys passed to the target's forward besides ids and attention mask.

    Required hooks (a family class without them is refused when it is defined, naming the hook):

    - every family: ``encode(processor, config, texts, audios, padding_side) -> dict`` of tensors.
    - audio families: ``audio_tokens(config, num_samples) -> int``, decoder positions of one audio.
    - encoder-decoder families: ``render_decoder(tokenizer, messages, add_generation_prompt)`` renders a
      conversation as the decoder's token stream (prompt, then response and end token), in place of a chat
      template; and ``decoder_config(config)``: the decoder's dimensions as a config with the usual names
      (``hidden_size``, ``num_hidden_layers``, ...), for sizing the draft (`text_config`).

    Optional, family-specific behaviour (the default is the usual one):

    - ``render_with``: ``"processor"`` or ``"tokenizer"``: whose chat template renders conversations.
    - ``sampling_rate``; ``chunk_seconds``: fixed audio chunk length (Voxtral: 30 s), else None.
    - ``sample_problem(config, tokenizer, cut) -> (field, problem, fix) | None``: the family's own checks of one
      sample's fields (Whisper: a known ``lang``, audio within one 30 s window).
    - ``max_positions(config) -> int | None``: decoder positions a sample may occupy (Whisper: 448).
    - ``encoder_mask_key``: encoder-decoder families whose encoder takes a padding mask (Moonshine): the batch key
      holding it; the target's forward gets it as ``attention_mask`` (the decoder's as ``decoder_attention_mask``).
    - ``stream_ids(tokenizer, text) -> list[int] | None``: the ids of a rendered stream that is not tokenized as one
      string (Moonshine: its transcript alone); the sample validator counts with it, as ``encode`` does.
    - ``prepare_forward(model, kwargs) -> kwargs`` for the frozen target's training forward, e.g. Moonshine's
      encoder run on each utterance alone (its output depends on the batch's padding).

    Optional fast paths (:data:`FAST_PATH_HOOKS`; the same results, less work):

    - ``prebuilt_packed_mask``: the family's packed forward takes a prebuilt 4D decoder mask unchanged (checked
      against transformers' own mask: `FrozenTarget.packed_sdpa_mask`).
    - ``prebuilt_padded_mask``: the same for a padded batch (`FrozenTarget.padded_decoder_mask`): its 2D mask is
      read only to build the decoder's causal mask (and, for Whisper, the decoder positions computed beside it).
    - ``graph_capturable``: the training forward (its encoder included) reads nothing back to the host once its
      decoder mask is prebuilt, so that it can be captured as a CUDA graph (`target_cuda_graph`).
    - ``host_facts(model, host_batch) -> dict | None``: what the target's forward would otherwise read back from the
      device, computed by the trainer's plan from the host batch (Qwen3-ASR: its audio encoder's windows);
      ``forward_inputs(model, kwargs, host_facts) -> kwargs`` then builds the forward's inputs with them (the two
      come together).
    - ``window_frames(config) -> int | None``: feature frames of the encoder's fixed window (Whisper: 3000). The
      training collator then gives compact features (`whisper_features.COMPACT_FEATURES_KEY`: the frames that hold
      audio and one padding frame) where its extractor's window is that long, and the frozen target rebuilds the
      window on its device (`whisper_features.expand_window`).
    """

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]] = ()
    expansion: ClassVar[str]
    audio_kwargs: ClassVar[tuple[str, ...]] = ()
    render_with: ClassVar[str] = "processor"
    sampling_rate: ClassVar[int] = SAMPLING_RATE
    chunk_seconds: ClassVar[float | None] = None
    encoder_mask_key: ClassVar[str | None] = None
    prebuilt_packed_mask: ClassVar[bool] = False
    prebuilt_padded_mask: ClassVar[bool] = False
    graph_capturable: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in vars(cls):  # a family (intermediate bases such as `EncoderDecoderFamily` set no name)
            problems = family_problems(cls)
            if problems:
                raise TypeError(f"target family {cls.name!r}: {'; '.join(problems)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    @property
    def has_audio(self) -> bool:
        return self.expansion != "none"

    @property
    def is_encoder_decoder(self) -> bool:
        return self.expansion == "encoder"

    def overrides(self, hook: str) -> bool:
        """Whether this family gives its own `hook` (a method of `TargetFamily` with a default)."""
        return _overrides(type(self), hook)

    # --- required hooks ------------------------------------------------------------------------------------------
    def encode(self, processor, config, texts: Sequence[str], audios: Sequence, padding_side: str) -> dict:
        """The batch of rendered `texts` and their `audios` as the target takes it (`registry.encode_batch`)."""
        raise NotImplementedError(f"target family {self.name!r} gives no encode")

    def audio_tokens(self, config, num_samples: int) -> int:
        """Decoder positions of one audio of `num_samples` samples (audio families)."""
        raise NotImplementedError(f"target family {self.name!r} has no audio in its decoder stream")

    # --- optional hooks (the usual behaviour) --------------------------------------------------------------------
    def text_config(self, config):
        """The decoder's config (for an encoder-decoder target, its decoder dimensions under the usual names)."""
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def sample_problem(self, config, tokenizer, cut) -> tuple[str, str, str] | None:
        return None

    def max_positions(self, config) -> int | None:
        return None

    def stream_ids(self, tokenizer, text: str) -> list[int] | None:
        return None

    def prepare_forward(self, model, kwargs: dict) -> dict:
        return kwargs

    def host_facts(self, model, batch: dict) -> dict | None:
        return None

    def forward_inputs(self, model, kwargs: dict, host: dict) -> dict:
        raise NotImplementedError(f"target family {self.name!r} gives no host_facts, so no forward_inputs")

    def window_frames(self, config) -> int | None:
        return None


class EncoderDecoderFamily(TargetFamily):
    """An encoder-decoder target (``expansion == "encoder"``): the audio reaches the decoder through cross-attention,
    so the decoder stream holds no audio; the family renders the decoder's own prompt instead of a chat template
    (`render_decoder`) and sizes the draft from the decoder's dimensions (`decoder_config`)."""

    expansion: ClassVar[str] = "encoder"
    render_with: ClassVar[str] = "tokenizer"

    def audio_tokens(self, config, num_samples: int) -> int:
        return 0  # the audio is the encoder's, never in the decoder stream

    def render_decoder(self, tokenizer, messages: list[dict], add_generation_prompt: bool = False, **kwargs) -> str:
        raise NotImplementedError(f"target family {self.name!r} gives no render_decoder")

    def decoder_config(self, config):
        raise NotImplementedError(f"target family {self.name!r} gives no decoder_config")

    def text_config(self, config):
        return self.decoder_config(config)


def _overrides(cls: type, hook: str) -> bool:
    """Whether `cls` defines `hook` below the base class that declares it."""
    declared = next(base for base in reversed(cls.__mro__) if hook in vars(base))
    return getattr(cls, hook) is not getattr(declared, hook)


def family_problems(cls: type[TargetFamily]) -> list[str]:
    """What a family class lacks of the hooks its kind requires (empty when it is complete)."""
    problems = []
    expansion = getattr(cls, "expansion", None)
    if expansion not in EXPANSIONS:
        problems.append(f"expansion must be one of {EXPANSIONS}, got {expansion!r}")
    if not _overrides(cls, "encode"):
        problems.append("encode is required (the batch encoder of the family's samples)")
    if expansion not in ("none", "encoder") and not _overrides(cls, "audio_tokens"):
        problems.append("audio families require audio_tokens (decoder positions of one audio)")
    if expansion == "encoder":
        if not issubclass(cls, EncoderDecoderFamily):
            problems.append("encoder-decoder families subclass EncoderDecoderFamily")
        else:
            missing = [name for name in ("render_decoder", "decoder_config") if not _overrides(cls, name)]
            if missing:
                problems.append(f"encoder-decoder families require {' and '.join(missing)}")
    if cls.render_with not in RENDERERS:
        problems.append(f"render_with must be 'processor' or 'tokenizer', got {cls.render_with!r}")
    if _overrides(cls, "host_facts") != _overrides(cls, "forward_inputs"):
        problems.append("host_facts and forward_inputs come together (the fast path needs both)")
    return problems


# ---------------------------------------------------------------------------------------------- helpers


def audio_token_id(family: TargetFamily, config) -> int | None:
    """The audio placeholder id from the target config (``config.audio_token_id``; Qwen2-Audio and Granite
    Speech alias it to ``audio_token_index``); None for text targets."""
    if not family.has_audio or family.is_encoder_decoder:
        return None
    value = getattr(config, "audio_token_id", None)
    if value is None:
        raise ValueError(
            f"family {family.name!r}: the target config ({type(config).__name__}) has no audio_token_id; "
            "set config.audio_token_id to the id of the audio placeholder token"
        )
    return int(value)


def config_field(config, name: str):
    """`config.name`, or `config[name]` for a config read as a dict (`config.json`); None when absent."""
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def get_tokenizer(processor):
    """The tokenizer inside a processor (or the tokenizer itself for text targets)."""
    return getattr(processor, "tokenizer", processor)


def mel_frames(num_samples: int) -> int:
    return -(-num_samples // HOP_LENGTH)


def special_prefix(tokenizer) -> str | None:
    """The first special token the tokenizer adds to a text (a BOS, Whisper's ``<|startoftranscript|>``), or its
    ``bos_token`` when it adds none."""
    added = tokenizer("", add_special_tokens=True)["input_ids"]
    return tokenizer.convert_ids_to_tokens(added[0]) if added else getattr(tokenizer, "bos_token", None)


def add_special_tokens_for(prefix: str | None, texts: Sequence[str]) -> bool:
    """Mirror ``apply_chat_template(tokenize=True)``: don't add the special prefix the tokenizer adds (`prefix`, from
    `special_prefix`: a BOS, Whisper's ``<|startoftranscript|>...``) when the rendered texts already hold it (at the
    start, or for Whisper after the ``<|startofprev|>`` previous-text prompt)."""
    return not (prefix and all(prefix in t for t in texts))


def should_add_special_tokens(tokenizer, texts: Sequence[str]) -> bool:
    """`add_special_tokens_for` with the tokenizer's prefix found now (it tokenizes: keep the prefix where it is
    asked per sample)."""
    return add_special_tokens_for(special_prefix(tokenizer), texts)


def tokenize_padded(tokenizer, texts: Sequence[str], padding_side: str, add_special_tokens: bool) -> dict:
    """``input_ids`` and ``attention_mask`` (``[b, S]`` int64) of ``texts`` padded on ``padding_side``: what
    ``tokenizer(..., padding=True, return_tensors="pt")`` returns, made from the padded lists in one ``torch.tensor``
    call each (transformers' conversion walks every id in Python first)."""
    out = tokenizer(
        list(texts),
        padding=True,
        padding_side=padding_side,
        add_special_tokens=add_special_tokens,
        return_attention_mask=True,
    )
    return {key: torch.tensor(out[key], dtype=torch.long) for key in ("input_ids", "attention_mask")}


def select_outputs(out, keys: Sequence[str]) -> dict:
    missing = [k for k in keys if k not in out]
    if missing:
        raise KeyError(f"processor output lacks {missing}; it returned {sorted(out.keys())}")
    return {k: out[k] for k in keys}
