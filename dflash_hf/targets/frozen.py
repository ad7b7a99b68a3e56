"""The frozen target: loading, validation, tap hooks and `target_argmax` labels (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TypeAlias

import torch
import transformers
from torch import nn

from dflash_hf.models.configuration_dflash import check_target_layer_ids, decoder_attends_fully
from dflash_hf.settings import ModelSettings
from dflash_hf.settings.draft import PRECISION_DTYPES, check_precision
from dflash_hf.targets.decoder_masks import (
    PREBUILT_MASK_MODEL_TYPES,
    check_packing,
    one_document_filling,
    packed_causal_mask,
    padded_causal_mask,
    without_packed_detection,
)
from dflash_hf.targets.families.base import DecoderStreams
from dflash_hf.targets.families.registry import (
    decoder_positions,
    decoder_stream_kwargs,
    decoder_streams,
    resolve_family,
)
from dflash_hf.targets.families.whisper_features import with_whole_window

DTYPES = {name: getattr(torch, dtype) for name, dtype in PRECISION_DTYPES.items()}
# Batch keys that belong to dflash_hf, never to the target's forward.
NON_TARGET_KEYS = frozenset({"loss_mask", "cu_seqlens", "max_seqlen", "doc_ids", "sample_ids", "labels", "num_docs"})


def resolve_dtype(precision: str) -> torch.dtype:
    check_precision(precision)
    return DTYPES[precision]


def load_target(
    name_or_path: str,
    precision: str = ModelSettings.precision,
    strict: bool = ModelSettings.target_strict_load,
    attn_implementation: str | None = None,
    trust_remote_code: bool = ModelSettings.trust_remote_code,
) -> nn.Module:
    """Load a target from a local directory (or hub id already in the local cache).

    The class is the one named in the checkpoint's `config.architectures`. Loading is strict: every
    parameter must come from the checkpoint (`strict=False` allows intentional partial init). A config with an
    `auto_map` (modeling code shipped with the checkpoint) is refused unless `trust_remote_code`.
    """
    config_dict, _ = transformers.PretrainedConfig.get_config_dict(name_or_path)
    if config_dict.get("auto_map") and not trust_remote_code:
        raise ValueError(
            f"target {name_or_path!r}: its config.json has an auto_map ({', '.join(sorted(config_dict['auto_map']))}), "
            "modeling code of its own that loading it would run; pass trust_remote_code=True (--trust_remote_code "
            "true) only if you trust that code, else use a target that transformers implements"
        )
    config = transformers.AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        cls = transformers.AutoModelForCausalLM
    kwargs = {"dtype": resolve_dtype(precision)}
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model, info = cls.from_pretrained(name_or_path, output_loading_info=True, **kwargs)
    if strict:
        check_complete(
            name_or_path,
            info,
            "--target_name_or_path",
            ", or set --target_strict_load false for an intentional partial initialization",
        )
    return model


def check_complete(name_or_path: str, loading_info: dict, option: str, alternative: str = "") -> None:
    """Refuse a checkpoint that left parameters of its model at their random initialization (`from_pretrained`'s
    `output_loading_info`), naming the `option` that points at it."""
    missing = list(loading_info.get("missing_keys", []))
    if missing:
        raise ValueError(
            f"target checkpoint {name_or_path!r} lacks {len(missing)} parameters, e.g. {missing[:8]}. "
            f"Point {option} at a complete checkpoint{alternative}."
        )


FINAL_NORM_NAMES = ("norm", "layer_norm")  # decoder-only LMs; Whisper-style encoder-decoder decoders


def final_norm_of(decoder: nn.Module) -> nn.Module | None:
    """The decoder's final norm (`norm`, or `layer_norm` in Whisper-style decoders)."""
    for name in FINAL_NORM_NAMES:
        norm = getattr(decoder, name, None)
        if isinstance(norm, nn.Module):
            return norm
    return None


def _decoder_of(model: nn.Module) -> nn.Module:
    """The text decoder: the module holding `layers` and the final norm (`norm` / `layer_norm`)."""
    candidates = [model]
    if hasattr(model, "get_decoder"):
        candidates.insert(0, model.get_decoder())
    for name in ("model", "language_model"):
        sub = getattr(model, name, None)
        if isinstance(sub, nn.Module):
            candidates.append(sub)
            if hasattr(sub, "get_decoder"):
                candidates.append(sub.get_decoder())
    for c in candidates:
        if isinstance(getattr(c, "layers", None), nn.ModuleList) and final_norm_of(c) is not None:
            return c
    raise ValueError(
        f"cannot find the text decoder (a module with `.layers` and `.norm` or `.layer_norm`) in "
        f"{type(model).__name__}; add a target family for it (a TargetFamily subclass in dflash_hf/targets/families/)"
    )


@dataclass
class TargetFeatures:
    taps: torch.Tensor  # [b, S, n_taps*H] raw outputs of the tapped layers (pre final norm)
    final_hidden: torch.Tensor | None  # [b, S, H] final-normed last layer (for target_argmax)
    encoder_hidden: torch.Tensor | None = None  # [b, F, E] an encoder-decoder target's encoder output


class FrozenTarget:
    """Wraps the frozen target. Never trained: eval mode, no grad, its own parameter dtype, no autocast."""

    def __init__(self, model: nn.Module, family: str | None = None):
        """`family`: a family name of `families.registry.FAMILIES` (`"qwen2_audio_single_placeholder"`...), default
        from the config's model_type."""
        self.model = model.eval().requires_grad_(False)
        self.family = resolve_family(model.config, family)
        self.decoder = _decoder_of(model)
        self.layers = self.decoder.layers
        self.final_norm = final_norm_of(self.decoder)
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        if self.lm_head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head); DFlash needs one")
        self._forward_params = set(inspect.signature(model.forward).parameters)
        self.suppressed_ids = sorted(set(getattr(getattr(model, "generation_config", 0), "suppress_tokens", 0) or ()))
        self._suppressed: dict[torch.device, torch.Tensor] = {}
        self.forward_graphs = None  # a `target_graph.TargetForwardGraphs` (`target_cuda_graph`), set by the trainer

    @classmethod
    def of(cls, target: TargetModel, family: str | None = None) -> FrozenTarget:
        """`target` as a `FrozenTarget`: itself if it is one, else the HF model wrapped (`family` as in `__init__`)."""
        return target if isinstance(target, FrozenTarget) else cls(target, family)

    # --- facts ---------------------------------------------------------------------------
    @property
    def text_config(self):
        """The decoder's config (for an encoder-decoder target, its decoder dimensions under the usual names)."""
        return self.family.text_config(self.model.config)

    @property
    def is_encoder_decoder(self) -> bool:
        return self.family.is_encoder_decoder

    @property
    def encoder_hidden_size(self) -> int | None:
        """Width of an encoder-decoder target's encoder output frames (`d_model`), None for a decoder-only target."""
        if not self.is_encoder_decoder:
            return None
        cfg = self.model.config
        return getattr(cfg, "d_model", None) or cfg.hidden_size  # Whisper: d_model; Moonshine: hidden_size

    num_layers = property(lambda self: len(self.layers))
    hidden_size = property(lambda self: self.embed_tokens.weight.shape[1])
    vocab_size = property(lambda self: self.embed_tokens.weight.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def special_ids(self) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for cfg in (self.model.config, self.text_config, getattr(self.model, "generation_config", None)):
            for name in ("pad_token_id", "eos_token_id"):
                v = getattr(cfg, name, None) if cfg is not None else None
                if v is None:
                    continue
                out.setdefault(name, set()).update(v if isinstance(v, (list, tuple)) else [v])
        return out

    def mask_token_candidates(self, tokenizer, limit: int = 5) -> list[int]:
        """Safe `mask_token_id` choices: embedding rows past the tokenizer's vocabulary, then, for Whisper-style
        targets decoded without timestamps, the timestamp tokens (text encoding never produces them)."""
        free = list(range(len(tokenizer), self.vocab_size))
        no_timestamps = getattr(getattr(self.model, "generation_config", None), "no_timestamps_token_id", None)
        if self.is_encoder_decoder and no_timestamps is not None:
            free += [i for i in range(no_timestamps + 1, min(len(tokenizer), self.vocab_size)) if i not in free]
        return free[:limit]

    # --- validation (before the draft is built) -------------------------------------------
    def validate(
        self, *, mask_token_id: int | None, target_layer_ids: list[int] | None, hidden_size: int | None = None
    ) -> None:
        if target_layer_ids is not None:
            check_target_layer_ids(target_layer_ids, self.num_layers)
        if hidden_size is not None and hidden_size != self.hidden_size:
            raise ValueError(
                f"draft hidden_size {hidden_size} != target hidden size {self.hidden_size}; the draft reads "
                "the target's embeddings and lm_head, so they must match"
            )
        if mask_token_id is None:
            raise ValueError(
                "mask_token_id is required: choose a token id the target's embedding has and your data never "
                "uses (e.g. an unused reserved special token)"
            )
        if not 0 <= mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {mask_token_id} has no row in the target's input embedding "
                f"(size {self.vocab_size}); pick an existing unused id (the embedding is never resized)"
            )
        for name, ids in self.special_ids().items():
            if mask_token_id in ids:
                raise ValueError(
                    f"mask_token_id {mask_token_id} equals the target's {name}; this silently hurts acceptance. "
                    "Pick a reserved token the data never uses"
                )
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"target dtype {self.dtype} is not supported; use precision fp32 or bf16")

    # --- forward ---------------------------------------------------------------------------
    @contextmanager
    def _hooks(self, layer_ids: list[int], store: dict, keep_final: bool):
        """Forward hooks storing the outputs of `layer_ids` (and of the final norm as `"final"`) in `store`."""
        handles = []

        def tap(idx):
            def hook(_module, _args, output):
                store[idx] = output[0] if isinstance(output, tuple) else output

            return hook

        for i in sorted(set(layer_ids)):
            handles.append(self.layers[i].register_forward_hook(tap(i)))
        if keep_final:
            handles.append(self.final_norm.register_forward_hook(tap("final")))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def streams(self, batch: dict) -> DecoderStreams:
        """Ids, masks and loss mask aligned 1:1 with the decoder positions (the taps), after any model-side
        audio expansion; audio positions are never supervised."""
        return decoder_streams(self.family, self.model, batch)

    def target_inputs(self, batch: dict, padded: bool | None = None, host: dict | None = None) -> dict:
        """Forward kwargs. A packed batch (it has `cu_seqlens`) goes without its 2D `attention_mask` and with
        `position_ids`: transformers detects packed documents from position restarts only when no 2D mask is
        given, and keeps attention inside each document (trailing padding forms its own segment); where
        `packed_sdpa_mask` applies, that 4D mask is given instead. `padded`: whether a padded batch has any
        padding, known on the host (the trainer's CPU plan); where the decoder's mask may be prebuilt, a padded
        batch gets `padded_decoder_mask` and one without padding no mask (`unmasked_causal`). Otherwise
        transformers builds the mask, reading the device mask once or twice per forward. `host`: `host_facts`."""
        kwargs = {k: v for k, v in self.whole_window(batch).items() if k not in NON_TARGET_KEYS}
        if self.unmasked_causal(batch, padded):  # no padding, one sequence a row: no mask (`features`)
            kwargs.pop("attention_mask", None)
        elif padded and "cu_seqlens" not in batch and "attention_mask" in kwargs and self.padded_decoder_mask_applies():
            if self.is_encoder_decoder:  # the decoder's positions count the real tokens of the 2D mask
                kwargs["decoder_position_ids"] = decoder_positions(kwargs["attention_mask"])
            kwargs["attention_mask"] = self.padded_decoder_mask(kwargs["attention_mask"])
        if self.is_encoder_decoder:
            kwargs = self.cast_features(
                decoder_stream_kwargs(kwargs, position_ids=True, encoder_mask_key=self.family.encoder_mask_key)
            )
            return self.family.prepare_forward(self.model, kwargs)
        if "cu_seqlens" in batch:
            if "position_ids" not in batch:
                raise ValueError(
                    "packed batch (it has cu_seqlens) without position_ids; the packing collator "
                    "must emit position_ids restarting at 0 per document"
                )
            kwargs.pop("attention_mask", None)
            mask = self.packed_sdpa_mask(batch)
            if mask is not None:
                kwargs["attention_mask"] = mask
        kwargs = self.cast_features(kwargs)
        return self.family.forward_inputs(self.model, kwargs, host) if host else kwargs

    def causal_full_attention(self) -> bool:
        """Whether the decoder's mask is only causal plus padding, for a decoder checked against it: an sdpa decoder
        of a model type in `PREBUILT_MASK_MODEL_TYPES` whose layers all attend fully (a prebuilt 4D mask reaches every
        layer unchanged, so it would take a sliding window's band away, and hybrid models read the 2D mask for their
        recurrent layers)."""
        config = self.decoder.config
        if getattr(config, "_attn_implementation", None) != "sdpa":
            return False
        return config.model_type in PREBUILT_MASK_MODEL_TYPES and decoder_attends_fully(config)

    def unmasked_causal(self, batch: dict, padded: bool | None) -> bool:
        """Whether the host knows the batch to be one causal sequence a row (no padding: `padded` False, or a packed
        row of one document filling it) for a decoder whose mask may be prebuilt: its forward then goes without a
        mask and without transformers' packed-sequence detection (`target_masks.without_packed_detection`), SDPA's
        `is_causal` path, which transformers takes after reading the mask (one host read fewer)."""
        if not self.padded_decoder_mask_applies():
            return False
        return one_document_filling(batch) if "cu_seqlens" in batch else padded is False

    def padded_decoder_mask_applies(self) -> bool:
        """Whether a padded batch's decoder mask may be prebuilt (`padded_decoder_mask`): a family checked against
        transformers' own mask, with a causal full-attention decoder."""
        return self.family.prebuilt_padded_mask and self.causal_full_attention()

    padded_decoder_mask = staticmethod(padded_causal_mask)

    def packed_sdpa_mask(self, batch: dict) -> torch.Tensor | None:
        """A packed row's decoder mask (`target_masks.packed_causal_mask`, transformers' sdpa mask without its host
        read of the positions). None (transformers' path) for decoders and families not checked against it, and for
        a row of one document without padding (no mask then); `cu_seqlens` and `max_seqlen` tell that on the host."""
        if not self.family.prebuilt_packed_mask or not self.causal_full_attention():
            return None
        if not isinstance(batch.get("max_seqlen"), int) or one_document_filling(batch):
            return None
        return packed_causal_mask(batch["position_ids"])

    def cast_features(self, kwargs: dict) -> dict:
        """Floating inputs (audio features) in the target's parameter dtype: the collator emits float32, a
        bf16 audio encoder refuses them. Integer ids and masks are left as they are."""
        return {k: v.to(self.dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}

    def check_packing(self) -> None:
        """Refuse packed batches when the decoder's attention implementation cannot isolate documents."""
        check_packing(self.decoder.config)

    @property
    def keeps_last_logits_only(self) -> bool:
        """Whether the target's forward takes `logits_to_keep` (then `logits_to_keep=1` skips `[S, vocab]` logits)."""
        return "logits_to_keep" in self._forward_params

    def tapped_forward(
        self, layer_ids: list[int], *, keep_final: bool = False, head: bool = True, **model_kwargs
    ) -> tuple[object, TargetFeatures]:
        """One target forward with `model_kwargs` exactly as the model takes them; returns its output and the
        features of `layer_ids` (raw decoder-layer outputs, before the final norm, concatenated) plus, with
        `keep_final`, the final-normed last layer, and an encoder-decoder target's encoder output. `head=False`
        runs an encoder-decoder target's base model (no `[S, vocab]` logits)."""
        store: dict = {}
        model = self.model if head or not self.is_encoder_decoder else self.model.base_model
        with self._hooks(layer_ids, store, keep_final):
            out = model(**model_kwargs)
        taps = torch.cat([store[i] for i in layer_ids], dim=-1)
        encoder = getattr(out, "encoder_last_hidden_state", None)
        return out, TargetFeatures(taps=taps, final_hidden=store.get("final"), encoder_hidden=encoder)

    @torch.no_grad()
    def capture(
        self,
        batch: dict,
        layer_ids: list[int],
        keep_final: bool = False,
        padded: bool | None = None,
        host: dict | None = None,
    ) -> TargetFeatures:
        """Run the target on its batch (its own padding and mask) and return the tapped features. The encoder of
        an encoder-decoder target runs once per utterance, under no_grad like the rest. `padded`: whether the batch
        has padding, if known on the host (`target_inputs`); `host`: the plan's `host_facts`. With `forward_graphs`
        (`target_cuda_graph`), a batch signature seen before replays its forward as a CUDA graph
        (`target_graph.TargetForwardGraphs`; a family with host facts reads the device elsewhere: never captured)."""
        batch = self.whole_window(batch)  # before a graph: its inputs keep the window's fixed shape
        if self.forward_graphs is not None and not host:
            return self.forward_graphs.features(self, batch, layer_ids, keep_final, padded)
        return self.features(batch, layer_ids, keep_final, padded, host)

    def host_facts(self, batch: dict) -> dict | None:
        """What the forward would read back from the device, found in the host batch (`TargetFamily.host_facts`)."""
        return self.family.host_facts(self.model, batch)

    def whole_window(self, batch: dict) -> dict:
        """`batch` with its compact features or waves (the trainer's Whisper loader) as the encoder's whole window."""
        config = self.model.config
        return with_whole_window(batch, self.family.window_frames(config), getattr(config, "num_mel_bins", None))

    def features(
        self,
        batch: dict,
        layer_ids: list[int],
        keep_final: bool = False,
        padded: bool | None = None,
        host: dict | None = None,
    ) -> TargetFeatures:
        """`capture`'s eager forward (no host read where the host knows the batch's layout: `target_inputs`)."""
        kwargs = self.target_inputs(batch, padded, host)
        kwargs["use_cache"] = False
        if self.keeps_last_logits_only:
            kwargs["logits_to_keep"] = 1  # no [S, vocab] logits
        with without_packed_detection() if self.unmasked_causal(batch, padded) else nullcontext():
            return self.tapped_forward(layer_ids, keep_final=keep_final, head=False, **kwargs)[1]

    def label_logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The scores of `target_argmax` / `target_distribution` labels: `suppress(lm_head(final_hidden))`."""
        return self.suppress(self.lm_head(final_hidden))

    def suppress(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` `[..., V]`, the ids `generate` always suppresses at -inf (`suppressed_ids`: Whisper's punctuation,
        task tokens; not its begin-suppressed ids, masked at the first position only; ids past V ignored)."""
        if self.suppressed_ids:
            if logits.device not in self._suppressed:  # one copy to each device, not one per call
                ids = [i for i in self.suppressed_ids if i < logits.shape[-1]]
                self._suppressed[logits.device] = torch.tensor(ids, dtype=torch.long, device=logits.device)
            logits = logits.index_fill(-1, self._suppressed[logits.device], float("-inf"))
        return logits


# What a public seam takes as `target` (`speculative_generate`, `DFlashTrainer`, `decode_benchmark`, ...): the HF
# model, or the `FrozenTarget` wrapping it (`FrozenTarget.of`).
TargetModel: TypeAlias = FrozenTarget | transformers.PreTrainedModel
