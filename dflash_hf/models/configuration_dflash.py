"""Configuration of DFlash / DFlash2 drafts.

Remote-code safe: imports only torch/transformers and its sibling `draft_fields.py` (the defaults and checks of the
draft's fields, pure Python, copied into every export with this file). The serialized `config.json` follows the
published DFlash checkpoint contract: Qwen3 draft fields, `"model_type": "qwen3"`, top-level
`block_size` and `num_target_layers`, and a `dflash_config` block holding the draft-specific fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import Qwen3Config
from transformers.utils import logging

from .draft_fields import (
    CONTRACT_KEYS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_NUM_DRAFT_LAYERS,
    DEFAULT_VARIANT,
    DFLASH2_FIELDS,
    DFLASH_VARIANTS,
    DFlash2Fields,
    check_block_size,
    check_distinct_taps,
    check_target_layer_ids,
    default_gamma,
    default_target_layer_ids,
)

logger = logging.get_logger(__name__)

ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
# Drafts outside the published contract (the encoder-context opt-in) are written under names no serving engine
# registers, so an engine refuses them instead of dropping the tensors it does not know. Older exports of such drafts
# carry the contract names and still load.
OUTSIDE_CONTRACT_ARCHITECTURES = {
    "dflash": "DFlashEncoderContextDraftModel",
    "dflash2": "DFlash2EncoderContextDraftModel",
}
DRAFT_ARCHITECTURES = (*ARCHITECTURES.values(), *OUTSIDE_CONTRACT_ARCHITECTURES.values())
# The draft's RoPE is full-head 1-D RoPE (modeling_dflash.DFlashRotaryEmbedding): multimodal RoPE sections and a
# partial rotary factor of a speech target's text config describe nothing the draft computes, and an engine building
# the draft's rotary from `rope_parameters` would apply them. They are never part of a draft config.
TARGET_ONLY_ROPE_KEYS = ("mrope_section", "mrope_interleaved", "interleaved", "partial_rotary_factor")
# rope types whose positions the draft's 1-D RoPE computes exactly (multimodal RoPE on a text-only stream is 1-D)
ONE_D_ROPE_TYPES = ("default", "mrope")
# The draft MLP is SwiGLU with SiLU whatever the target uses (modeling_dflash.DFlashMLP); the config says so.
DRAFT_HIDDEN_ACT = "silu"


def decoder_attends_fully(config) -> bool:
    """Whether every layer of a target decoder with this config attends to every earlier position: no sliding
    window's band and no layer of another kind (hybrid models), so an explicit causal mask reproduces it."""
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        return False
    return getattr(config, "sliding_window", None) is None or not getattr(config, "use_sliding_window", True)


def draft_rope_parameters(rope: Mapping | None, default_theta: float | None = None) -> dict:
    """The `rope_parameters` of what the draft computes, `{"rope_type": "default", "rope_theta": theta}`, from a
    target's (or an export's) rope parameters: the target-only keys (`TARGET_ONLY_ROPE_KEYS`) are not kept. `theta`
    is the given one, else `default_theta` (absent when both are). Other rope types (scaled RoPE) are returned as
    given: the draft refuses them when it is built."""
    rope = dict(rope or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ONE_D_ROPE_TYPES:
        return rope
    theta = rope.get("rope_theta", default_theta)
    return {"rope_type": "default"} | ({"rope_theta": float(theta)} if theta is not None else {})


class DFlashConfig(Qwen3Config):
    """Config of a DFlash (v1) or DFlash2 draft.

    Besides the Qwen3 fields describing the draft decoder, it declares these typed fields (a dataclass, as
    transformers' configs; their defaults and checks are `draft_fields`'):

    Args:
        block_size (`int`): draft slots per anchor (the anchor token plus `block_size - 1` predictions).
        num_target_layers (`int`): decoder layers of the target the taps index into.
        dflash_config (`dict`): the published contract's entries, as serialized: `block_size`, `mask_token_id`,
            `target_layer_ids` (`CONTRACT_KEYS`) and, for DFlash2, `conv_kernel_size`, `conv_group_size`,
            `selector_rank`, `selector_top_k` (`DFlash2Fields`). With the encoder-context opt-in (outside the
            published contract, see `encoder_hidden_size`) also `encoder_hidden_size`. Read through the typed
            properties below (`mask_token_id`, `target_layer_ids`, `encoder_hidden_size`, ...). What a training run
            used (anchors, conversation) is not model config: the export's training record holds it.
        is_causal (`bool`): always False (every slot of a block attends to the whole block); written at the top
            level because serving engines read causality from it before `layer_types`.
        variant (`str`, derived): `"dflash2"` when `architectures` names `DFlash2DraftModel` (or its
            outside-contract name).

    `rope_parameters` describe the draft's own full-head 1-D RoPE: a speech target's multimodal RoPE sections and
    partial rotary factor are dropped (`TARGET_ONLY_ROPE_KEYS`), also from configs saved before they were.
    """

    model_type = "qwen3"

    block_size: int = DEFAULT_BLOCK_SIZE
    num_target_layers: int | None = None
    dflash_config: dict[str, Any] | None = None
    is_causal: bool = False

    def __post_init__(self, **kwargs):
        """`dflash_config` always holds the contract keys (`mask_token_id` and `target_layer_ids` None until set)
        and the top-level `block_size`, which serving engines read (both copies kept in sync); the rope parameters
        are the draft's own (`draft_rope_parameters`, the target-only keys dropped)."""
        self.dflash_config = dict(self.dflash_config or {})
        self.dflash_config["block_size"] = self.block_size
        for key in CONTRACT_KEYS[1:]:
            self.dflash_config.setdefault(key, None)
        theta = kwargs.get("rope_theta")
        if isinstance(kwargs.get("rope_scaling"), Mapping):
            kwargs["rope_scaling"] = draft_rope_parameters(kwargs["rope_scaling"], theta)
        if isinstance(self.rope_parameters, Mapping):
            self.rope_parameters = draft_rope_parameters(self.rope_parameters, theta)
        for key in TARGET_ONLY_ROPE_KEYS:
            kwargs.pop(key, None)
        super().__post_init__(**kwargs)
        if isinstance(getattr(self, "rope_parameters", None), Mapping):
            self.rope_parameters = draft_rope_parameters(self.rope_parameters, getattr(self, "rope_theta", None))

    # --- convenience accessors -------------------------------------------------------------
    @property
    def variant(self) -> str:
        archs = getattr(self, "architectures", None) or []
        dflash2 = (ARCHITECTURES["dflash2"], OUTSIDE_CONTRACT_ARCHITECTURES["dflash2"])
        return "dflash2" if any(a in dflash2 for a in archs) else "dflash"

    @property
    def architecture(self) -> str:
        """The architecture name an export carries: the published contract's `DFlashDraftModel` /
        `DFlash2DraftModel`, or for a draft outside it (encoder context) a name no serving engine knows."""
        names = OUTSIDE_CONTRACT_ARCHITECTURES if self.encoder_context else ARCHITECTURES
        return names[self.variant]

    @property
    def in_published_contract(self) -> bool:
        """Whether engines implementing the published DFlash contract (vLLM, SGLang) can serve this draft."""
        return not self.encoder_context

    @property
    def mask_token_id(self) -> int | None:
        return self.dflash_config.get("mask_token_id")

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.dflash_config["target_layer_ids"])

    @property
    def num_taps(self) -> int:
        return len(self.dflash_config["target_layer_ids"])

    @property
    def encoder_hidden_size(self) -> int | None:
        """Width of an encoder-decoder target's encoder frames the draft attends to (the encoder-context opt-in,
        `--draft_encoder_context`), or None: the published DFlash contract, where the audio reaches the draft only
        through the tapped decoder states. Engines implementing the contract cannot serve a draft that has it."""
        return self.dflash_config.get("encoder_hidden_size")

    @property
    def encoder_context(self) -> bool:
        return self.encoder_hidden_size is not None

    def loss_gamma(self, gamma: float | None = None) -> float:
        """The slot decay gamma of the loss: `gamma` if given, else the recipe default for this block size."""
        return gamma if gamma is not None else default_gamma(self.block_size)

    def set_block_size(self, block_size: int) -> None:
        """Change the block size (weights do not depend on it), keeping both copies in sync."""
        check_block_size(block_size)
        self.block_size = block_size
        self.dflash_config["block_size"] = block_size

    @classmethod
    def from_target_config(
        cls,
        target_text_config,
        *,
        mask_token_id: int,
        variant: str = DEFAULT_VARIANT,
        num_hidden_layers: int = DEFAULT_NUM_DRAFT_LAYERS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        target_layer_ids: list[int] | None = None,
        encoder_hidden_size: int | None = None,
        **overrides,
    ) -> DFlashConfig:
        """Draft config whose dimensions default from the target's text (decoder) config. `overrides`: draft
        config fields, and for DFlash2 any of the `DFlash2Fields` (`conv_kernel_size`, ...; defaults there).
        `encoder_hidden_size`: the encoder-context opt-in (outside the published contract), None = off."""
        dflash2 = DFlash2Fields(**{k: overrides.pop(k) for k in DFLASH2_FIELDS if k in overrides})
        if variant not in DFLASH_VARIANTS:
            raise ValueError(f"variant must be one of {DFLASH_VARIANTS}, got {variant!r}")
        if num_hidden_layers < 1:
            raise ValueError(f"num_draft_layers (num_hidden_layers) must be >= 1, got {num_hidden_layers}")
        t = target_text_config
        num_target_layers = t.num_hidden_layers
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_hidden_layers)
            if len(set(target_layer_ids)) < len(target_layer_ids):
                logger.warning(
                    "default target_layer_ids %s repeat layers: a %d-layer target has too few layers in 1..L-3 for "
                    "%d distinct taps; set target_layer_ids to choose them",
                    target_layer_ids,
                    num_target_layers,
                    num_hidden_layers,
                )
        else:
            check_distinct_taps(target_layer_ids)
        dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)}
        if variant == "dflash2":
            dflash_config.update(dflash2.as_dict())
        if encoder_hidden_size is not None:
            dflash_config["encoder_hidden_size"] = encoder_hidden_size
            dflash_config["outside_published_contract"] = ["encoder_hidden_size"]  # said in the config itself
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        rope = draft_rope_parameters(getattr(t, "rope_parameters", None), getattr(t, "rope_theta", None) or 1e6)
        fields = dict(
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_attention_heads=t.num_attention_heads,
            num_key_value_heads=getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
            rope_parameters=dict(rope),
            max_position_embeddings=getattr(t, "max_position_embeddings", 32768),
            vocab_size=t.vocab_size,
            hidden_act=DRAFT_HIDDEN_ACT,
            tie_word_embeddings=False,
        )
        fields.update(overrides)
        config = cls(
            block_size=block_size,
            num_target_layers=num_target_layers,
            dflash_config=dflash_config,
            num_hidden_layers=num_hidden_layers,
            architectures=[
                (OUTSIDE_CONTRACT_ARCHITECTURES if encoder_hidden_size is not None else ARCHITECTURES)[variant]
            ],
            **fields,
        )
        config.validate_dflash()
        return config

    def validate_dflash(self) -> None:
        """Check the DFlash-specific fields; raise a ValueError naming the field and the fix."""
        dc = self.dflash_config
        check_block_size(self.block_size)
        check_target_layer_ids(dc.get("target_layer_ids"), self.num_target_layers, "dflash_config.target_layer_ids")
        if getattr(self, "hidden_act", DRAFT_HIDDEN_ACT) != DRAFT_HIDDEN_ACT:
            raise ValueError(
                f"hidden_act={self.hidden_act!r}: the draft MLP is SwiGLU with {DRAFT_HIDDEN_ACT!r} "
                f"(modeling_dflash); set hidden_act to {DRAFT_HIDDEN_ACT!r}"
            )
        self.check_mask_token_id()
        if self.is_causal or dc.get("causal"):
            raise ValueError(
                "is_causal / dflash_config.causal is true, but a DFlash draft attends bidirectionally within its block "
                "(serving engines read this field); set is_causal to false and drop dflash_config.causal"
            )
        archs = getattr(self, "architectures", None) or []
        if any(a in OUTSIDE_CONTRACT_ARCHITECTURES.values() for a in archs) and not self.encoder_context:
            raise ValueError(
                f"architectures {archs} names an encoder-context draft but dflash_config has no encoder_hidden_size; "
                f"set architectures to [{ARCHITECTURES[self.variant]!r}] or restore encoder_hidden_size"
            )
        if self.variant == "dflash2":
            self.check_dflash2()
        width = dc.get("encoder_hidden_size")
        if width is not None and (type(width) is not int or width < 1):
            raise ValueError(
                f"dflash_config.encoder_hidden_size must be a positive int (the target encoder's width) "
                f"or absent, got {width!r}"
            )

    def check_mask_token_id(self, embedding_rows: int | None = None) -> None:
        """`dflash_config.mask_token_id` is an integer row of the target's input embedding, as serving engines embed
        it (`vocab_size` is the target's embedding rows; `embedding_rows`, when given, the target's own count)."""
        mask = self.dflash_config.get("mask_token_id")
        if mask is None:
            raise ValueError("dflash_config.mask_token_id is not set: pick an id the target embeds and data never uses")
        if isinstance(mask, bool) or not isinstance(mask, int):
            raise ValueError(f"dflash_config.mask_token_id must be an integer token id, got {mask!r}")
        rows = {"vocab_size": getattr(self, "vocab_size", None), "the target's embedding": embedding_rows}
        for name, size in rows.items():
            if size is not None and not 0 <= mask < size:
                raise ValueError(
                    f"dflash_config.mask_token_id {mask} has no row in {name} ({size} rows); serving engines embed "
                    f"the mask id with the target's embedding: pick an id in [0, {size})"
                )

    def check_dflash2(self) -> None:
        """DFlash2's `dflash_config` fields are all present and consistent with the draft's dimensions."""
        missing = [k for k in DFLASH2_FIELDS if k not in self.dflash_config]
        if missing:
            raise ValueError(f"DFlash2 config lacks dflash_config fields {missing}; build it with variant='dflash2'")
        DFlash2Fields.of(self.dflash_config).check(self.hidden_size, self.vocab_size, prefix="dflash_config.")

    def to_dict(self) -> dict:
        """Also writes `rope_theta` at the top level (beside `rope_parameters`): engines whose config classes
        predate `rope_parameters` read only that key, and would otherwise fall back to their default theta. Writes
        `is_causal` and the architecture name of `architecture` (what engines decide on)."""
        out = super().to_dict()
        out["is_causal"] = bool(self.is_causal)  # engines read it before layer_types (and before dflash_config)
        if any(a in DRAFT_ARCHITECTURES for a in out.get("architectures") or []):
            out["architectures"] = [self.architecture]  # whichever class saved it: the name follows the contract
        rope = out.get("rope_parameters") or {}
        if isinstance(rope, dict) and rope.get("rope_theta") is not None:
            out["rope_theta"] = rope["rope_theta"]
        return out


__all__ = [
    "ARCHITECTURES",
    "OUTSIDE_CONTRACT_ARCHITECTURES",
    "DFlash2Fields",
    "DFlashConfig",
    "default_target_layer_ids",
    "default_gamma",
    "draft_rope_parameters",
]
