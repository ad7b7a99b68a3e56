"""Draft checkpoints in and out: strict warm start, export, conversion (publishing is `hub.py`'s).

- :func:`load_draft_strict`: weights-only warm start from a draft export (docs/ARCHITECTURE.md). Every missing,
  unexpected or wrongly shaped tensor is an error naming it; quantized exports are refused.
- :func:`export_draft`: the checkpoint contract, LoRA merged (serving needs nothing new).
- the DFlash -> DFlash2 conversion is :mod:`dflash_hf.export.conversion`'s.

Exports are atomic (:func:`write_atomically`): written into a hidden sibling directory and renamed into place, so a
process killed while exporting over an older export leaves the older export whole (or, killed between the two
renames, no export under that name and the older one beside it), never new files beside old weights. A draft with
non-finite weights is never exported, and loading one is an error naming the tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from dflash_hf.errors import DFlashUserError
from dflash_hf.export.atomic_write import staging_siblings, write_atomically
from dflash_hf.export.run_record import RUN_RECORD
from dflash_hf.export.training_record import (
    LEGACY_KEYS,
    TRAINING_RECORD_FILE,
    read_json_object,
    read_training_record,
)
from dflash_hf.models.configuration_dflash import DRAFT_ARCHITECTURES, DFlashConfig
from dflash_hf.models.modeling_dflash import DFlashDraftModel
from dflash_hf.targets.builder import draft_class_for

logger = logging.getLogger("dflash_hf.export.hub")  # the name these messages have always been logged under

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# Files a draft export may hold besides its weights; anything else is noted and ignored on load.
REMOTE_CODE_FILES = ("configuration_dflash.py", "draft_fields.py", "modeling_dflash.py", "modeling_dflash_encoder.py")
# (RUN_RECORD: the training run an export is of, written by the trainer)
EXPORT_FILES = ("config.json", *REMOTE_CODE_FILES, "README.md", "generation_config.json", RUN_RECORD)
EXPORT_FILES += (TRAINING_RECORD_FILE,)  # what the training run used that evaluation repeats
# safetensors dtype codes of full-precision exports; anything else (U8, I8, F8_*, I32 ...) is quantized/packed.
FLOAT_DTYPES = ("F32", "BF16", "F16")
QUANT_CONFIG_KEYS = ("quantization_config", "compression_config")
QUANT_FILES = ("hf_quant_config.json", "quant_config.json", "quantize_config.json")


# ------------------------------------------------------------------------------------------------
# Warm start: strict weights-only loading
# ------------------------------------------------------------------------------------------------
def _quantized_error(path: Path, reason: str) -> ValueError:
    return ValueError(
        f"{path} is a quantized draft export ({reason}); warm start needs a BF16 or FP32 export of the "
        "draft (save the unquantized draft with save_pretrained, or dequantize it first)"
    )


def resolve_draft_dir(path: str | Path) -> Path:
    """A local export directory, or a Hub repo id already in the local cache (no download)."""
    local = Path(path)
    if local.is_dir():
        return local
    if local.exists():
        raise NotADirectoryError(f"init_from_pretrained={str(path)!r} is a file; give the draft export directory")
    previous = staging_siblings(local, "previous")
    if previous:
        raise FileNotFoundError(
            f"{local} does not exist: an export into it was interrupted between replacing the older export and "
            f"moving the new one in; the older, complete export is at {previous[0]} (rename it back) or export again"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(path), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as err:
        raise FileNotFoundError(
            f"init_from_pretrained={str(path)!r} is neither a local directory nor a Hub repo in the local cache; "
            f"download it first (`hf download {path}`) or pass the export directory"
        ) from err


def _read_config_json(directory: Path) -> dict:
    """The export's config.json, read."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory} has no config.json; it is not a DFlash draft export")
    return read_json_object(config_file)


def _draft_config(directory: Path, raw: dict, block_size: int | None) -> DFlashConfig:
    """The DFlash config of the export in `directory` from its config.json `raw` (`_read_config_json`), checked;
    `block_size`, when given, replaces the saved one."""
    config_file = directory / "config.json"
    for key in QUANT_CONFIG_KEYS:
        if raw.get(key):
            method = raw[key].get("quant_method", "?") if isinstance(raw[key], dict) else "?"
            raise _quantized_error(directory, f"config.json has `{key}` (quant_method={method})")
    for name in QUANT_FILES:
        if (directory / name).is_file():
            raise _quantized_error(directory, f"it ships {name}")
    archs = raw.get("architectures") or []
    known = [a for a in archs if a in DRAFT_ARCHITECTURES]
    if len(known) != 1:
        raise ValueError(
            f"{config_file}: `architectures` is {archs}; a draft export names exactly one of "
            f"{sorted(DRAFT_ARCHITECTURES)}"
        )
    dflash_config = raw.get("dflash_config")
    if not isinstance(dflash_config, dict):
        raise ValueError(f"{config_file} has no `dflash_config` object; it is not a DFlash draft export")
    saved_block = raw.get("block_size", dflash_config.get("block_size"))
    if saved_block is None:
        raise ValueError(
            f"{config_file} has neither top-level `block_size` nor `dflash_config.block_size`; "
            "pass block_size explicitly"
        )
    # training metadata older exports kept in dflash_config is their training record's (`read_training_record`)
    dflash_config = {k: v for k, v in dflash_config.items() if k not in LEGACY_KEYS}
    config = DFlashConfig.from_dict({**raw, "block_size": int(saved_block), "dflash_config": dflash_config})
    if block_size is not None and block_size != config.block_size:
        logger.info("Warm start: block_size %d (saved) -> %d (weights do not depend on it)", saved_block, block_size)
        config.set_block_size(block_size)
    config.validate_dflash()
    return config


def weight_file_paths(directory: Path) -> list[Path]:
    index = directory / WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no `weight_map`; the sharded export is incomplete")
        shards = sorted(set(weight_map.values()))
        absent = [s for s in shards if not (directory / s).is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists shards that are not in {directory}: {absent}")
        return [directory / s for s in shards]
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return [single]
    others = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    hint = f" (found {others}: re-export with save_pretrained(safe_serialization=True))" if others else ""
    raise FileNotFoundError(f"{directory} has no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}{hint}")


def _note_extra_files(directory: Path, weight_files: list[Path]) -> None:
    known = set(EXPORT_FILES) | {WEIGHTS_INDEX_NAME} | {p.name for p in weight_files}
    extra = sorted(p.name for p in directory.iterdir() if p.name not in known and not p.name.startswith("."))
    if extra:
        logger.warning("Warm start from %s: ignoring non-weight files %s", directory, extra)


def _open_weights(file: Path):
    """`safe_open` of one weight file; a truncated or corrupt file is an error naming it."""
    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as err:
        raise ValueError(
            f"{file} is not a readable safetensors file ({err}); it is truncated or corrupt: copy or export "
            "the draft again"
        ) from err


def _weight_dtypes(directory: Path, weight_files: list[Path]) -> dict[str, str]:
    """name -> safetensors dtype of every tensor (headers only); quantized/packed dtypes are refused."""
    dtypes: dict[str, str] = {}
    where: dict[str, Path] = {}
    packed = []
    for file in weight_files:
        with _open_weights(file) as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                if dtype not in FLOAT_DTYPES:
                    packed.append(f"{name} ({dtype})")
                if name in dtypes:
                    raise ValueError(f"tensor {name!r} appears in both {where[name].name} and {file.name}")
                dtypes[name], where[name] = dtype, file
    if packed:
        more = f" and {len(packed) - 5} more" if len(packed) > 5 else ""
        raise _quantized_error(directory, f"tensors in packed/quantized dtypes: {', '.join(packed[:5])}{more}")
    return dtypes


def _read_state_dict(directory: Path, weight_files: list[Path]) -> dict[str, torch.Tensor]:
    """All tensors of the export; a non-float (quantized/packed) tensor is refused before any is loaded, a
    non-finite one after reading."""
    _weight_dtypes(directory, weight_files)
    state: dict[str, torch.Tensor] = {}
    for file in weight_files:
        with _open_weights(file) as f:
            for name in f.keys():
                try:
                    state[name] = f.get_tensor(name)
                except SafetensorError as err:
                    raise ValueError(f"{file}: tensor {name!r} cannot be read ({err}); export the draft again") from err
    bad = non_finite_tensors(state)
    if bad:
        raise DFlashUserError(
            f"{directory} holds a draft with non-finite weights (NaN or inf) in {_list_names(bad)}; it cannot "
            "decode. Export a checkpoint from before training diverged, or train again"
        )
    return state


def non_finite_tensors(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors of `state` holding a NaN or an infinity."""
    return [
        name
        for name, t in state.items()
        if torch.is_floating_point(t) and t.numel() and not bool(torch.isfinite(t).all())
    ]


def _list_names(names: list[str], shown: int = 8) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{len(names)} tensor{'s' if len(names) > 1 else ''}: {', '.join(names[:shown])}{more}"


def check_draft_export(path: str | Path, block_size: int | None = None) -> DFlashConfig:
    """Cheap checks of a warm-start export before anything expensive runs: the directory, `config.json`
    (valid JSON, a DFlash config) and the weight files' headers (readable, not quantized). Its config."""
    directory = resolve_draft_dir(path)
    return _checked_export(directory, _read_config_json(directory), block_size)


def _checked_export(directory: Path, raw: dict, block_size: int | None) -> DFlashConfig:
    """`check_draft_export` of the export in `directory` whose config.json `raw` is already read."""
    config = _draft_config(directory, raw, block_size)
    _weight_dtypes(directory, weight_file_paths(directory))
    return config


def check_warm_start_export(path: str | Path) -> dict[str, int]:
    """`check_draft_export` of a warm-start export, then what it records of its training run: the `block_size` of its
    config.json and, when the run recorded it, its `num_anchors` (the export's training record); each file is read
    once. A training record that cannot be read gives {}."""
    directory = resolve_draft_dir(path)
    raw = _read_config_json(directory)
    _checked_export(directory, raw, None)
    try:
        num_anchors = read_training_record(directory, raw).num_anchors
    except (OSError, ValueError):
        return {}
    dflash_config = raw.get("dflash_config") or {}
    found = {"block_size": raw.get("block_size", dflash_config.get("block_size")), "num_anchors": num_anchors}
    return {k: v for k, v in found.items() if isinstance(v, int)}


def load_draft_strict(path: str | Path, block_size: int | None = None) -> DFlashDraftModel:
    """Weights-only warm start from a draft export (a `save_pretrained` directory or a cached Hub id).

    Strict: every missing, unexpected or wrongly shaped tensor is named in one error. Quantized exports
    (a `quantization_config`, or tensors in packed/quantized dtypes) are refused. `block_size`, when
    given, replaces the saved block size (no weight depends on it) and is what a later export writes.
    Returns the draft in float32 (or the saved float dtype's values cast to float32), in train mode.
    """
    directory = resolve_draft_dir(path)
    config = _draft_config(directory, _read_config_json(directory), block_size)
    weight_files = weight_file_paths(directory)
    _note_extra_files(directory, weight_files)
    state = _read_state_dict(directory, weight_files)
    model = draft_class_for(config)(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs draft {tuple(expected[k].shape)}"
        for k in set(expected) & set(state)
        if state[k].shape != expected[k].shape
    )
    if missing or unexpected or wrong:
        parts = [
            f"{label} ({len(names)}): {names}"
            for label, names in (
                ("missing tensors", missing),
                ("unexpected tensors", unexpected),
                ("wrongly shaped tensors", wrong),
            )
            if names
        ]
        raise ValueError(
            f"strict warm start from {directory} failed for {config.architectures[0]} "
            f"(hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_taps} taps); "
            + "; ".join(parts)
        )
    model.load_state_dict(state, strict=True)
    return model.train()


# ------------------------------------------------------------------------------------------------
# Export and conversion
# ------------------------------------------------------------------------------------------------
def check_exportable(draft: nn.Module, vocab_size: int | None = None, tokenizer=None) -> None:
    """What an export must hold before anything is written: a plain DFlash draft, every weight finite, and a mask id
    the serving engines can embed: inside the target's embedding (`vocab_size`, its rows, when given) and, with the
    target's `tokenizer`, none of its named special tokens (pad, eos, bos, ...)."""
    if not isinstance(draft, DFlashDraftModel):
        raise TypeError(
            f"export_draft needs a plain DFlash draft, got {type(draft).__name__} "
            "(merge a LoRA draft first: dflash_hf.training.adaptation.plain_draft)"
        )
    bad = non_finite_tensors(draft.state_dict())
    if bad:
        raise DFlashUserError(
            f"the draft has non-finite weights (NaN or inf) in {_list_names(bad)}; it is not exported (it could not "
            "decode). Training diverged: resume from an earlier checkpoint with a lower learning_rate"
        )
    config = draft.config
    config.check_mask_token_id(vocab_size)
    if vocab_size is not None and config.vocab_size != vocab_size:
        raise ValueError(
            f"the draft's vocab_size {config.vocab_size} differs from the target's {vocab_size} embedding rows; "
            "serving engines size the draft's vocabulary from the target: export a draft trained on this target"
        )
    if tokenizer is not None:
        mask = config.mask_token_id
        roles = {
            role: tokenizer.convert_tokens_to_ids(token)
            for role, token in (getattr(tokenizer, "special_tokens_map", None) or {}).items()
            if role != "mask_token" and isinstance(token, str)
        }
        clash = sorted(role for role, token_id in roles.items() if token_id == mask)
        if clash:
            raise ValueError(
                f"dflash_config.mask_token_id {mask} is the tokenizer's {', '.join(clash)}; the engines feed the mask "
                "id to every drafted slot: train the draft with an id the data never uses"
            )


def export_draft(
    draft: nn.Module,
    export_dir: str | Path,
    *,
    vocab_size: int | None = None,
    tokenizer=None,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write a plain draft in the checkpoint contract (docs/ARCHITECTURE.md): config.json, model.safetensors and the
    remote-code files, atomically (`write_atomically`). A LoRA draft is merged before it gets here
    (`training.adaptation.plain_draft`). Checked first (`check_exportable`): finite weights, and with the target's
    `vocab_size` (embedding rows) and `tokenizer` given, a mask id the serving engines embed as trained.
    `write_extra(directory)` adds files that belong to the export (a run record, ...) before it is moved into place."""
    check_exportable(draft, vocab_size, tokenizer)
    draft.config.validate_dflash()

    def write(staging: Path) -> None:
        draft.save_pretrained(staging, safe_serialization=True)
        if write_extra is not None:
            write_extra(staging)

    return write_atomically(export_dir, write)


__all__ = [
    "load_draft_strict",
    "check_draft_export",
    "check_warm_start_export",
    "export_draft",
    "check_exportable",
    "non_finite_tensors",
    "resolve_draft_dir",
    "weight_file_paths",
]
