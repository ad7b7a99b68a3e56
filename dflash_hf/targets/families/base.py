"""What every target family row is made of (`TargetFamily`, `DecoderStreams`) and the helpers the rows share;
the rows themselves are in `registry.py` (and `whisper.py`, `moonshine.py` for the encoder-decoder rows)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class TargetFamily:
    """One row of :data:`FAMILIES`: the hooks every family gives, the optional ones that change what a family does,
    and the optional fast paths (which change only speed: a row without them takes the generic path).

    Required of every row (checked when the row is made):

    - ``name``: the family name (``resolve_family(config, name=...)`` accepts it).
    - ``model_types``: config ``model_type`` values this row matches.
    - ``expansion``: ``"processor"`` (placeholders expanded by the processor), ``"model"`` (one placeholder
      per audio, expanded inside the model), ``"encoder"`` (encoder-decoder: the audio goes to the encoder, the
      token stream is the decoder's) or ``"none"`` (text-only target).
    - ``audio_kwargs``: batch keys passed to the target's forward besides ids and attention mask.
    - ``encode``: ``encode(family, processor, config, texts, audios, padding_side) -> dict`` of tensors.
    - audio rows: ``audio_tokens``: ``audio_tokens(config, num_samples) -> int``, decoder positions of one audio.
    - encoder-decoder rows: ``render_decoder``: ``render_decoder(tokenizer, messages, add_generation_prompt)``
      renders a conversation as the decoder's token stream (prompt, then response and end token); used in place
      of a chat template; and ``decoder_config``: ``decoder_config(config)`` the decoder's dimensions as a config
      with the usual names (``hidden_size``, ``num_hidden_layers``, ...), for sizing the draft.

    Optional, family-specific behaviour (the default is the usual one):

    - ``render_with``: ``"processor"`` or ``"tokenizer"``: whose chat template renders conversations.
    - ``chunk_seconds``: fixed audio chunk length (Voxtral: 30 s), else None.
    - ``sample_problem``: ``sample_problem(config, tokenizer, cut) -> (field, problem, fix) | None``: the
      family's own checks of one sample's fields (Whisper: a known ``lang``, audio within one 30 s window).
    - ``max_positions``: ``max_positions(config) -> int``: decoder positions a sample may occupy (Whisper: 448).
    - ``encoder_mask_key``: encoder-decoder rows whose encoder takes a padding mask (Moonshine): the batch key
      holding it; the target's forward gets it as ``attention_mask`` (the decoder's as ``decoder_attention_mask``).
    - ``stream_ids``: ``stream_ids(tokenizer, text) -> list[int]`` when a rendered stream is not tokenized as one
      string (Moonshine: its transcript alone); the sample validator counts with it, as ``encode`` does.
    - ``prepare_forward``: ``prepare_forward(model, kwargs) -> kwargs`` for the frozen target's training forward,
      e.g. Moonshine's encoder run on each utterance alone (its output depends on the batch's padding).

    Optional fast paths (:data:`FAST_PATH_HOOKS`; the same results, less work):

    - ``prebuilt_packed_mask``: the row's packed forward takes a prebuilt 4D decoder mask unchanged (checked
      against transformers' own mask: `FrozenTarget.packed_sdpa_mask`).
    - ``prebuilt_padded_mask``: the same for a padded batch (`FrozenTarget.padded_decoder_mask`): its 2D mask is
      read only to build the decoder's causal mask (and, for Whisper, the decoder positions computed beside it).
    - ``graph_capturable``: the training forward (its encoder included) reads nothing back to the host once its
      decoder mask is prebuilt, so that it can be captured as a CUDA graph (`target_cuda_graph`).
    - ``host_facts``: ``host_facts(model, host_batch) -> dict | None``: what the target's forward would otherwise read
      back from the device, computed by the trainer's plan from the host batch (Qwen3-ASR: its audio encoder's
      windows); ``forward_inputs(model, kwargs, host_facts) -> kwargs`` then builds the forward's inputs with them
      (the two come together).
    - ``window_frames``: ``window_frames(config) -> int``: feature frames of the encoder's fixed window (Whisper:
      3000). The training collator then gives compact features (`whisper_features.COMPACT_FEATURES_KEY`: the frames
      that hold audio and one padding frame) where its extractor's window is that long, and the frozen target
      rebuilds the window on its device (`whisper_features.expand_window`).
    """

    name: str
    model_types: tuple[str, ...]
    expansion: str
    audio_kwargs: tuple[str, ...]
    encode: Callable = field(repr=False)
    audio_tokens: Callable | None = field(default=None, repr=False)
    render_with: str = "processor"
    sampling_rate: int = SAMPLING_RATE
    chunk_seconds: float | None = None
    description: str = ""
    render_decoder: Callable | None = field(default=None, repr=False)
    decoder_config: Callable | None = field(default=None, repr=False)
    sample_problem: Callable | None = field(default=None, repr=False)
    max_positions: Callable | None = field(default=None, repr=False)
    encoder_mask_key: str | None = None
    prepare_forward: Callable | None = field(default=None, repr=False)
    stream_ids: Callable | None = field(default=None, repr=False)
    prebuilt_packed_mask: bool = False
    prebuilt_padded_mask: bool = False
    graph_capturable: bool = False
    window_frames: Callable | None = field(default=None, repr=False)
    host_facts: Callable | None = field(default=None, repr=False)
    forward_inputs: Callable | None = field(default=None, repr=False)

    def __post_init__(self):
        problems = family_problems(self)
        if problems:
            raise ValueError(f"target family {self.name!r}: {'; '.join(problems)}")

    @property
    def has_audio(self) -> bool:
        return self.expansion != "none"

    @property
    def is_encoder_decoder(self) -> bool:
        return self.expansion == "encoder"


EXPANSIONS = ("processor", "model", "encoder", "none")
# The optional hooks that change only speed (a row without them takes the generic path).
FAST_PATH_HOOKS = (
    "prebuilt_packed_mask",
    "prebuilt_padded_mask",
    "graph_capturable",
    "host_facts",
    "forward_inputs",
    "window_frames",
)


def family_problems(family: TargetFamily) -> list[str]:
    """What a row lacks of the hooks its kind requires (empty when it is complete)."""
    problems = []
    if family.expansion not in EXPANSIONS:
        problems.append(f"expansion must be one of {EXPANSIONS}, got {family.expansion!r}")
    if not callable(family.encode):
        problems.append("encode is required (the batch encoder of the family's samples)")
    if family.expansion != "none" and family.audio_tokens is None:
        problems.append("audio rows require audio_tokens (decoder positions of one audio)")
    if family.expansion == "encoder":
        missing = [name for name in ("render_decoder", "decoder_config") if getattr(family, name) is None]
        if missing:
            problems.append(f"encoder-decoder rows require {' and '.join(missing)}")
    if family.render_with not in ("processor", "tokenizer"):
        problems.append(f"render_with must be 'processor' or 'tokenizer', got {family.render_with!r}")
    if (family.host_facts is None) != (family.forward_inputs is None):
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


def get_tokenizer(processor):
    """The tokenizer inside a processor (or the tokenizer itself for text targets)."""
    return getattr(processor, "tokenizer", processor)


def _mel_frames(num_samples: int) -> int:
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


def _add_special_tokens(tokenizer, texts: Sequence[str]) -> bool:
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


def _select(out, keys: Sequence[str]) -> dict:
    missing = [k for k in keys if k not in out]
    if missing:
        raise KeyError(f"processor output lacks {missing}; it returned {sorted(out.keys())}")
    return {k: out[k] for k in keys}
