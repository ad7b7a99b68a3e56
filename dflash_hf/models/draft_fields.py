"""The draft's fields: the defaults, help and checks of what a draft config holds (`dflash_config`'s published
contract fields, the block size, the taps) and how a new draft is sized.

Remote code, and pure Python: `configuration_dflash.py` imports it relatively, so `save_pretrained` copies it into
every export beside the config, and `dflash_hf.settings` (the one source of every training default, which must not
import torch or transformers) imports it by name and shows these values as its own. A value here is written nowhere
else in the package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

DFLASH_VARIANTS = ("dflash", "dflash2")
DEFAULT_VARIANT = DFLASH_VARIANTS[0]
DEFAULT_BLOCK_SIZE = 16
# Largest supported block size. Published recipes use 8 to 16; the dense block mask and the per-block
# supervision grow with block_size * num_anchors, and 128 is the flex attention tile (a block never spans two).
MAX_BLOCK_SIZE = 128
DEFAULT_NUM_DRAFT_LAYERS = 5  # decoder layers of a new draft
# Decay constant gamma of the slot weights w_k = exp(-(k-1)/gamma) used by the published recipes.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
# `dflash_config` keys of the published contract (DFlash2 adds `DFLASH2_FIELDS`).
CONTRACT_KEYS = ("block_size", "mask_token_id", "target_layer_ids")


@dataclass(frozen=True)
class DFlash2Fields:
    """DFlash2's `dflash_config` entries: the one place their defaults, help and checks are written (the settings,
    `DFlashConfig.from_target_config`, the DFlash -> DFlash2 conversion and the model read them here)."""

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


def check_block_size(block_size: int, name: str = "block_size") -> None:
    """2 <= block_size <= MAX_BLOCK_SIZE, else a ValueError naming `name` and the fix."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 2 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(
            f"{name} must be an integer in [2, {MAX_BLOCK_SIZE}] (the anchor plus at least one prediction; "
            f"published recipes use 8 to 16), got {block_size!r}"
        )


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


def default_gamma(block_size: int) -> float:
    """Loss decay gamma: the recipe value for B=8/10/16, otherwise B/2 (about the same curve)."""
    return DEFAULT_GAMMA.get(block_size, max(block_size / 2.0, 1.0))


__all__ = [
    "CONTRACT_KEYS",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_GAMMA",
    "DEFAULT_NUM_DRAFT_LAYERS",
    "DEFAULT_VARIANT",
    "DFLASH2_FIELDS",
    "DFLASH_VARIANTS",
    "MAX_BLOCK_SIZE",
    "DFlash2Fields",
    "check_block_size",
    "check_distinct_taps",
    "check_target_layer_ids",
    "default_gamma",
    "default_target_layer_ids",
]
