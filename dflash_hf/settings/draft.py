"""The settings of the models: the frozen target and how it is loaded (`ModelSettings`), and the draft trained
against it (`DraftSettings`: variant, size, taps, mask id, block size and DFlash2's fields). Light: no torch, no
transformers.

The draft's contract values (variants, block sizes, DFlash2's fields, the tap checks) are those of
`dflash_hf.models.draft_fields`, the remote-code file every export carries: read there, written nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from dflash_hf.models.draft_fields import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_NUM_DRAFT_LAYERS,
    DEFAULT_VARIANT,
    DFLASH_VARIANTS,
    MAX_BLOCK_SIZE,
    DFlash2Fields,
    check_block_size,
    check_distinct_taps,
    check_target_layer_ids,
)
from dflash_hf.settings.checks import Settings, count, setting

PRECISIONS = ("fp32", "bf16")
# every name a precision option takes (the long names too) -> its torch dtype's name (`targets.frozen.resolve_dtype`)
PRECISION_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}


def check_precision(precision: str) -> None:
    """`precision` is a name of `PRECISION_DTYPES`, else a `ValueError` naming them."""
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"precision must be one of {sorted(PRECISION_DTYPES)}, got {precision!r}")


def _dflash2(name: str):
    """A DFlash2 field as a setting: its default and help are `DFlash2Fields`'."""
    spec = next(f for f in fields(DFlash2Fields) if f.name == name)
    return setting(spec.default, spec.metadata["help"])


@dataclass
class ModelSettings(Settings):
    """The frozen target, the draft export a run starts from or validates, and where the trained draft goes."""

    target_name_or_path: str | None = setting(None, "Local directory (or cached hub id) of the frozen target.")
    target_family: str | None = setting(
        None,
        "Target family row (docs/DATA.md); default from the config's model_type. "
        "qwen2_audio_single_placeholder selects the model-side audio expansion (NeMo SALM layout).",
    )
    precision: str = setting("fp32", "Parameter dtype of target AND draft (no autocast).", choices=PRECISIONS)
    init_from_pretrained: str | None = setting(None, "Warm start: a draft export directory (weights only, strict).")
    export_dir: str | None = setting(None, "Where the final draft is exported (default: <output_dir>/draft).")
    target_strict_load: bool = setting(
        True, "Require every target parameter in its checkpoint. False = intentional partial init."
    )
    trust_remote_code: bool = setting(
        False,
        "Load a target whose config.json has an auto_map (its own modeling code, run in this process). "
        "Off: such a target is refused. Set it only for a target directory whose code you trust.",
    )
    target_cuda_graph: bool | None = setting(
        None,
        "Replay the frozen target's training forward as a CUDA graph for batch shapes seen before "
        "(the same kernels, none of the host work; docs/PERFORMANCE.md). Unset: on a GPU where the target "
        "can be captured (text and Whisper families, sdpa decoders with full attention), falling back to the "
        "eager forward with a warning if a capture fails; true: always (refused where it cannot run); false: "
        "never. The graphs keep one forward's intermediates and each kept shape's taps allocated (up to a "
        "few GiB): set false when memory is tight.",
    )


@dataclass
class DraftSettings(Settings):
    """The draft: its variant and size (a warm start keeps the export's), the target layers it taps, its mask token,
    its block size and DFlash2's fields. `block_size` unset means `DEFAULT_BLOCK_SIZE` or, with
    `init_from_pretrained`, the export's."""

    variant: str = setting(DEFAULT_VARIANT, "dflash or dflash2.", choices=DFLASH_VARIANTS)
    num_draft_layers: int = setting(
        DEFAULT_NUM_DRAFT_LAYERS, "Decoder layers of a new draft (a warm start keeps the export's)."
    )
    target_layer_ids: list[int] | None = setting(
        None, "0-based target decoder layers to tap, each once; default spreads 1..L-3."
    )
    mask_token_id: int | None = setting(
        None, "Reserved token id with a row in the target embedding, unused by the data."
    )
    block_size: int | None = setting(
        None,
        f"Draft slots per anchor (anchor + B-1 predictions), 2..{MAX_BLOCK_SIZE}; default {DEFAULT_BLOCK_SIZE}, "
        "or the init_from_pretrained export's block size.",
    )
    conv_kernel_size: int = _dflash2("conv_kernel_size")
    conv_group_size: int = _dflash2("conv_group_size")
    selector_rank: int = _dflash2("selector_rank")
    selector_top_k: int = _dflash2("selector_top_k")
    draft_encoder_context: bool = setting(
        False,
        "Encoder-decoder targets (Whisper) only, OUTSIDE the published DFlash contract (engines "
        "implementing it cannot serve the draft): each draft layer also cross-attends to the target's "
        "encoder frames, initialized from the cross-attention of the target's top decoder layers. "
        "docs/QUALITY.md measures what it buys.",
    )

    RANGES = {"num_draft_layers": count(1)}

    @classmethod
    def validate(cls, values) -> None:
        super().validate(values)
        if values.block_size is not None:  # else the init_from_pretrained export's (resolved before training)
            check_block_size(values.block_size)
        if values.target_layer_ids is not None:
            check_target_layer_ids(values.target_layer_ids)
            check_distinct_taps(values.target_layer_ids)
        DFlash2Fields.of(values).check()


__all__ = ["PRECISIONS", "PRECISION_DTYPES", "DraftSettings", "ModelSettings", "check_precision"]
