"""Configuration of DFlash / DFlash2 drafts.

Remote-code safe: imports only torch/transformers. The serialized `config.json` follows the
published DFlash checkpoint contract: Qwen3 draft fields, `"model_type": "qwen3"`, top-level
`block_size` and `num_target_layers`, and a `dflash_config` block holding the draft-specific fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

from transformers import Qwen3Config
from transformers.utils import logging

logger = logging.get_logger(__name__)

DFLASH_VARIANTS = ("dflash", "dflash2")
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
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class DFlash2Fields:
    """DFlash2's `dflash_config` entries: the one place their defaults, help and checks are written (the training
    arguments, `DFlashConfig.from_target_config`, the DFlash -> DFlash2 conversion and the model read them here)."""

    conv_kernel_size: int = field(default=2, metadata={"help": "DFlash2: taps of the dynamic convolutions."})
    conv_group_size: int = field(
        default=16, metadata={"help": "DFlash2: channels sharing one dynamic coefficient (divides hidden size)."}
    )
    selector_rank: int = field(default=256, metadata={"help": "DFlash2: rank of the path selector codebooks."})
    selector_top_k: int = field(default=16, metadata={"help": "DFlash2: candidates per slot of the path selector."})

    @classmethod
    def of(cls, values: Mapping | object) -> DFlash2Fields:
        """The fields found in a mapping (a `dflash_config`) or on an object (training arguments)."""
        get = values.get if isinstance(values, Mapping) else lambda k, d: getattr(values, k, d)
        return cls(**{f.name: get(f.name, f.default) for f in fields(cls)})

    @classmethod
    def help(cls, name: str) -> str:
        return next(f.metadata["help"] for f in fields(cls) if f.name == name)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def check(self, hidden_size: int | None = None, vocab_size: int | None = None, prefix: str = "") -> None:
        """Raise a ValueError naming the field (`prefix` + name, as the user spelled it) and the fix."""
        for name, value in self.as_dict().items():
            if int(value) < 1:
                raise ValueError(f"{prefix}{name} must be >= 1, got {value}")
        if hidden_size is not None and hidden_size % self.conv_group_size:
            raise ValueError(f"{prefix}conv_group_size {self.conv_group_size} must divide hidden_size {hidden_size}")
        if vocab_size is not None and self.selector_top_k > vocab_size:
            raise ValueError(
                f"{prefix}selector_top_k {self.selector_top_k} exceeds vocab_size {vocab_size}; lower "
                "selector_top_k or set vocab_size to the target's vocabulary"
            )


DFLASH2_FIELDS = tuple(f.name for f in fields(DFlash2Fields))
# Decay constant gamma of the slot weights w_k = exp(-(k-1)/gamma) used by the published recipes.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
# Largest supported block size. Published recipes use 8 to 16; the dense block mask and the per-block
# supervision grow with block_size * num_anchors, and 128 is the flex attention tile (a block never spans two).
MAX_BLOCK_SIZE = 128
# The draft MLP is SwiGLU with SiLU whatever the target uses (modeling_dflash.DFlashMLP); the config says so.
DRAFT_HIDDEN_ACT = "silu"


def check_block_size(block_size: int, name: str = "block_size") -> None:
    """2 <= block_size <= MAX_BLOCK_SIZE, else a ValueError naming `name` and the fix."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 2 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(
            f"{name} must be an integer in [2, {MAX_BLOCK_SIZE}] (the anchor plus at least one prediction; "
            f"published recipes use 8 to 16), got {block_size!r}"
        )


def decoder_attends_fully(config) -> bool:
    """Whether every layer of a target decoder with this config attends to every earlier position: no sliding
    window's band and no layer of another kind (hybrid models), so an explicit causal mask reproduces it."""
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        return False
    return getattr(config, "sliding_window", None) is None or not getattr(config, "use_sliding_window", True)


def check_target_layer_ids(ids, num_target_layers: int | None = None, name: str = "target_layer_ids") -> None:
    """Non-empty integer layer indices, in range when `num_target_layers` is known."""
    if not ids:
        raise ValueError(f"{name} is empty: give at least one target layer to tap")
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"{name} must be a list of integer layer indices, got {list(ids)!r}")
    bad = [i for i in ids if i < 0 or (num_target_layers is not None and i >= num_target_layers)]
    if bad:
        valid = f"0..{num_target_layers - 1}" if num_target_layers is not None else ">= 0"
        layers = f" for a target with {num_target_layers} decoder layers" if num_target_layers is not None else ""
        raise ValueError(f"{name} {bad} out of range{layers} (valid: {valid})")


def check_distinct_taps(ids, name: str = "target_layer_ids") -> None:
    """Taps the user chose must name each layer once (a repeated tap only repeats features)."""
    repeated = sorted({i for i in ids if list(ids).count(i) > 1})
    if repeated:
        raise ValueError(f"{name}={list(ids)} taps layers {repeated} more than once; give each target layer once")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default taps: `[L // 2]` for one draft layer, else spread evenly from layer 1 to layer L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(
            f"target has {num_target_layers} decoder layers; the default tap formula needs >= 4. "
            "Set `target_layer_ids` explicitly."
        )
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


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


def default_gamma(block_size: int) -> float:
    """Loss decay gamma: the recipe value for B=8/10/16, otherwise B/2 (about the same curve)."""
    return DEFAULT_GAMMA.get(block_size, max(block_size / 2.0, 1.0))


class DFlashConfig(Qwen3Config):
    """Config of a DFlash (v1) or DFlash2 draft.

    Besides the Qwen3 fields describing the draft decoder, it holds:

    Args:
        block_size (`int`): draft slots per anchor (the anchor token plus `block_size - 1` predictions).
        num_target_layers (`int`): decoder layers of the target the taps index into.
        dflash_config (`dict`): `block_size`, `mask_token_id`, `target_layer_ids` and, for DFlash2,
            `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`. With the encoder-context
            opt-in (outside the published contract, see `encoder_hidden_size`) also `encoder_hidden_size`.
        is_causal (`bool`): always False (every slot of a block attends to the whole block); written at the top
            level because serving engines read causality from it before `layer_types`.
        variant (`str`, derived): `"dflash2"` when `architectures` names `DFlash2DraftModel` (or its
            outside-contract name).

    `rope_parameters` describe the draft's own full-head 1-D RoPE: a speech target's multimodal RoPE sections and
    partial rotary factor are dropped (`TARGET_ONLY_ROPE_KEYS`), also from configs saved before they were.
    """

    model_type = "qwen3"

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_target_layers: int | None = None,
        dflash_config: dict | None = None,
        is_causal: bool = False,
        **kwargs,
    ):
        dflash_config = dict(dflash_config or {})
        # The top-level block_size is what serving engines read; keep both in sync.
        dflash_config["block_size"] = block_size
        dflash_config.setdefault("mask_token_id", None)
        dflash_config.setdefault("target_layer_ids", None)
        self.block_size = block_size
        self.num_target_layers = num_target_layers
        self.dflash_config = dflash_config
        self.is_causal = is_causal
        for key in ("rope_parameters", "rope_scaling"):
            if isinstance(kwargs.get(key), Mapping):
                kwargs[key] = draft_rope_parameters(kwargs[key], kwargs.get("rope_theta"))
        for key in TARGET_ONLY_ROPE_KEYS:
            kwargs.pop(key, None)
        super().__init__(**kwargs)
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
        variant: str = "dflash",
        num_hidden_layers: int = 5,
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
