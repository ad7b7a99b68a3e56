"""A run directory belongs to one run (docs/RELIABILITY.md, "Run directories, resume and faults").

Every training run has a record, `dflash_run.json`: a random run id, the settings the draft is trained with (the
target's identity, the draft's shape and block settings, the training data) and their fingerprint, and the settings
changes a resume was explicitly allowed to make. The record is written in `output_dir` when the run starts, in every
checkpoint, and beside the export (in the export directory). A resume continues the run of the checkpoint it takes
and refuses changed settings, naming each (`--resume_allow_changes FIELD ...` accepts a deliberate change, which is
recorded); a new run refuses a directory holding another run's checkpoints or export unless `--overwrite_output_dir
true` is given.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dflash_hf.errors import DFlashUserError
from dflash_hf.export.atomic_write import is_draft_export
from dflash_hf.export.run_record import RUN_RECORD, RunDirectoryError, read_record
from dflash_hf.settings import DEFAULT_VARIANT

logger = logging.getLogger("dflash_hf")

# Settings a resume compares with its checkpoint's record; names as the command line spells them.
COMPARED_SETTINGS = (
    "target",
    "hidden_size",
    "target_layer_ids",
    "mask_token_id",
    "block_size",
    "variant",
    "num_draft_layers",
    "train_data",
)
# Changes no flag can allow: the checkpoint's weights do not fit a draft of other shapes.
SHAPE_SETTINGS = ("hidden_size", "num_draft_layers", "variant")
_SAMPLED_HASH_LIMIT = 256 << 20  # data files up to this size are hashed whole; larger ones by sampled chunks
_CHUNK = 1 << 16
_CHUNKS = 16


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def settings_fingerprint(settings: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_fingerprint(path: str | Path) -> str:
    """sha256 of a file's size and contents: whole for files up to 256 MiB, else of evenly spaced 64 KiB chunks."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= _SAMPLED_HASH_LIMIT:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        else:
            for i in range(_CHUNKS):
                f.seek((size - _CHUNK) * i // (_CHUNKS - 1))
                digest.update(f.read(_CHUNK))
    return digest.hexdigest()[:16]


def data_identity(train_dataset) -> list[dict] | str | None:
    """The training data as recorded: each file's resolved path and fingerprint (speech sources given as paths),
    an HF dataset's own fingerprint, or None when the data cannot be identified (not compared)."""
    items = train_dataset if isinstance(train_dataset, (list, tuple)) else [train_dataset]
    paths = [x if isinstance(x, (str, Path)) else getattr(x, "path", None) for x in items]  # paths or DataSources
    if items and all(isinstance(p, (str, Path)) and not getattr(x, "hf_dataset", None) for p, x in zip(paths, items)):
        return [
            {"path": str(Path(p).resolve()), "sha256": file_fingerprint(p) if Path(p).is_file() else None}
            for p in paths
        ]
    fingerprint = getattr(train_dataset, "_fingerprint", None)
    return fingerprint if isinstance(fingerprint, str) else None


def draft_variant(dflash_config: Mapping[str, Any] | None) -> str:
    """The variant a draft config's `dflash_config` describes: DFlash2 drafts carry their convolution fields."""
    return "dflash2" if "conv_kernel_size" in (dflash_config or {}) else DEFAULT_VARIANT


def run_settings(draft_config, target: dict[str, str], train_dataset) -> dict[str, Any]:
    """The settings a run's checkpoints are trained with (`COMPARED_SETTINGS`), from the built draft (resolved
    layer ids and block size), the target's identity (`target_identity`) and the training data."""
    dflash = draft_config.dflash_config or {}
    return {
        "target": dict(target),
        "hidden_size": int(draft_config.hidden_size),
        "target_layer_ids": list(dflash.get("target_layer_ids") or []),
        "mask_token_id": dflash.get("mask_token_id"),
        "block_size": int(draft_config.block_size),
        "variant": draft_variant(dflash),
        "num_draft_layers": int(draft_config.num_hidden_layers),
        "train_data": data_identity(train_dataset),
    }


def new_record(settings: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "run_id": new_run_id(),
        "settings": dict(settings),
        "settings_fingerprint": settings_fingerprint(settings),
        "changes": [],
    }


def export_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record written beside an export, which may be published: the run id, the settings' fingerprint and the
    allowed changes, with the target and data files named by their fingerprints and file names (no local paths)."""

    def public(name: str, value: Any) -> Any:
        if name == "target" and isinstance(value, dict):
            return {"fingerprint": value.get("fingerprint")}
        if name == "train_data" and isinstance(value, list):
            return [{"name": Path(d["path"]).name, "sha256": d["sha256"]} for d in value]
        return value

    settings = {k: public(k, v) for k, v in record["settings"].items()}
    changes = [
        c | {"before": public(c["field"], c["before"]), "after": public(c["field"], c["after"])}
        for c in record.get("changes") or []
    ]
    return {
        "run_id": record["run_id"],
        "settings": settings,
        "settings_fingerprint": record["settings_fingerprint"],
        "changes": changes,
    }


def _shown(name: str, value: Any) -> str:
    if name == "target" and isinstance(value, dict):
        return f"{value.get('name_or_path') or '(in memory)'} (weights fingerprint {value.get('fingerprint')})"
    if name == "train_data" and isinstance(value, list):
        return "[" + ", ".join(f"{d['path']} (sha256 {d['sha256']})" for d in value) + "]"
    return json.dumps(value, default=str)


def _same(name: str, before: Any, after: Any) -> bool:
    if before is None or after is None:
        return True  # not recorded (an older checkpoint, data without an identity): nothing to compare
    if name == "target":
        return before.get("fingerprint") == after.get("fingerprint")
    if name == "train_data" and isinstance(before, list) and isinstance(after, list):  # moved files are the same data
        return [d.get("sha256") or d.get("path") for d in before] == [d.get("sha256") or d.get("path") for d in after]
    return before == after


def setting_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Names of the compared settings whose values differ (a setting missing on either side is not compared)."""
    return [n for n in COMPARED_SETTINGS if not _same(n, recorded.get(n), current.get(n))]


def resumed_record(
    record: Mapping[str, Any] | None,
    checkpoint: str | Path,
    current: Mapping[str, Any],
    allowed: Iterable[str],
    step: int,
) -> dict[str, Any]:
    """The run record a resume from `checkpoint` continues: its own record with this run's settings, each difference
    either allowed by `--resume_allow_changes` (recorded under `changes` with the step) or refused, all named at
    once. A checkpoint without a record (an older dflash_hf) is compared by its draft config and gets a new run id."""
    if record is None:
        record = new_record(current) | {"settings": _settings_of_config(checkpoint, current)}
        logger.warning("resume: %s records no run identity (an older dflash_hf); this run gets a new one", checkpoint)
    elif "variant" in (weights := _settings_of_config(checkpoint, current)):
        # the checkpoint's weights say which variant they are (records of older versions always said "dflash")
        record = dict(record) | {"settings": dict(record["settings"]) | {"variant": weights["variant"]}}
    differences = setting_differences(record["settings"], current)
    allowed = set(allowed)
    shapes = [n for n in differences if n in SHAPE_SETTINGS]
    refused = [n for n in differences if n not in allowed or n in SHAPE_SETTINGS]
    if refused:
        lines = "; ".join(
            f"{n}: checkpoint {_shown(n, record['settings'].get(n))}, this run {_shown(n, current.get(n))}"
            for n in refused
        )
        fix = (
            f"the draft's weight shapes follow {', '.join(shapes)}, which cannot change on resume: resume with the "
            "checkpoint's values, or start a new run in another output_dir"
            if shapes
            else "resume with the checkpoint's values, start a new run in another output_dir, or accept the change "
            f"deliberately with --resume_allow_changes {' '.join(refused)} (recorded in the checkpoints and export)"
        )
        raise DFlashUserError(
            f"--resume_from_checkpoint {checkpoint}: the settings changed since it was saved ({lines}); {fix}"
        )
    changes = list(record.get("changes") or [])
    for name in differences:
        before, after = record["settings"].get(name), current.get(name)
        changes.append({"step": step, "field": name, "before": before, "after": after})
        logger.warning("resume: %s changed (allowed): %s -> %s", name, _shown(name, before), _shown(name, after))
    return dict(record) | {
        "settings": dict(current),
        "settings_fingerprint": settings_fingerprint(current),
        "changes": changes,
    }


def _settings_of_config(checkpoint: str | Path, current: Mapping[str, Any]) -> dict[str, Any]:
    """What an older checkpoint's draft config.json says of the compared settings (the rest unrecorded)."""
    try:
        config = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    dflash = config.get("dflash_config") or {}
    return {
        "hidden_size": config.get("hidden_size"),
        "target_layer_ids": dflash.get("target_layer_ids"),
        "mask_token_id": dflash.get("mask_token_id"),
        "block_size": config.get("block_size", dflash.get("block_size")),
        "variant": draft_variant(dflash),
        "num_draft_layers": config.get("num_hidden_layers"),
    }


# --- Run directories: what a run may write over ---------------------------------------------------------------
_CHECKPOINT_PREFIX = "checkpoint-"
_CHECKPOINT_NAME = re.compile(rf"^{_CHECKPOINT_PREFIX}\d+$")  # the Trainer's checkpoint-N
_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")


def _inside(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def _visible(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if not p.name.startswith(".")) if directory.is_dir() else []


def check_not_in_target(directory: str, option: str, target: str | None) -> None:
    """A directory a run writes must not be the target's directory or inside it."""
    if not target or not Path(target).expanduser().is_dir():
        return
    path, target_dir = Path(directory).expanduser().resolve(), Path(target).expanduser().resolve()
    if _inside(path, target_dir):
        raise RunDirectoryError(
            f"--{option} {directory} is the target's directory or inside it ({target}): the run would write over the "
            f"frozen target; choose a directory outside it"
        )


def owner_of(output_dir: str | Path) -> str | None:
    """The run id recorded in `output_dir`, None when there is none."""
    record = read_record(output_dir)
    return record["run_id"] if record else None


def model_files(output_dir: Path) -> list[str]:
    """Files that make `output_dir` a model's directory (a config.json or weights at its top level): a run writes
    its checkpoints and record beside whatever else is there, but never into another model's directory."""
    return [
        p.name
        for p in _visible(output_dir)
        if p.is_file() and (p.name == "config.json" or p.suffix in _MODEL_FILE_SUFFIXES)
    ]


def check_run_directories(
    output_dir: str,
    export_dir: str,
    *,
    resuming: bool,
    overwrite: bool,
    target: str | None = None,
) -> list[Path]:
    """Pre-flight of a training run's directories (before anything loads). Refused: `output_dir` or `export_dir`
    in the target's directory; an `output_dir` holding files no dflash-train run writes; an `export_dir` holding
    anything but a draft export; a new run (not `resuming`) where another run left its record, checkpoints or
    export, unless `overwrite`; a resume whose export directory holds another run's export. Returns what a
    deliberate overwrite replaces (the other run's checkpoints and export), for `clear_previous_run`."""
    out, export = Path(output_dir).expanduser(), Path(export_dir).expanduser()
    check_not_in_target(output_dir, "output_dir", target)
    check_not_in_target(export_dir, "export_dir", target)
    if out.exists() and not out.is_dir():
        raise RunDirectoryError(f"--output_dir {output_dir} is a file; give a directory")
    foreign = model_files(out) if out.is_dir() else []
    if foreign:
        raise RunDirectoryError(
            f"--output_dir {output_dir} is a model's directory ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}); a run must not write into it: choose an empty or new directory"
        )
    export_files = _visible(export)
    if export.exists() and not export.is_dir():
        raise RunDirectoryError(f"--export_dir {export_dir} is a file; give a directory")
    if export_files and not is_draft_export(export):
        raise RunDirectoryError(
            f"--export_dir {export_dir} holds files that are not a draft export "
            f"({', '.join(p.name for p in export_files[:5])}); choose an empty or new directory"
        )
    owner = owner_of(out) if out.is_dir() else None
    previous = [p for p in _visible(out) if _CHECKPOINT_NAME.match(p.name) and p.is_dir()]
    if export_files:
        previous.append(export)
    export_record = read_record(export) if export_files else None
    if resuming:
        if export_files and (export_record is None or export_record["run_id"] != owner):
            which = f"run {export_record['run_id']}" if export_record else "a run that recorded no run id"
            if not overwrite:
                raise RunDirectoryError(
                    f"--export_dir {export_dir} holds the export of {which}, not of the run in --output_dir "
                    f"{output_dir} (run {owner}); choose another --export_dir, or pass --overwrite_output_dir true "
                    "to replace it"
                )
            return [export]
        return []
    if not previous:  # at most a record of a run that saved nothing: nothing to lose
        return []
    if not overwrite:
        found = ", ".join(p.name for p in previous[:4]) + (", ..." if len(previous) > 4 else "")
        raise RunDirectoryError(
            f"--output_dir {output_dir} belongs to another run (run {owner or 'without a recorded id'}"
            f"{': ' + found if found else ''}); resume it with --resume_from_checkpoint true, choose a new "
            "--output_dir (and --export_dir), or pass --overwrite_output_dir true to start a new run here (the other "
            "run's checkpoints and export are removed)"
        )
    return previous


def clear_previous_run(paths: Iterable[Path], output_dir: str | Path) -> None:
    """Remove another run's checkpoints and export (a deliberate `--overwrite_output_dir true`), logged."""
    paths = list(paths)
    for path in paths:
        shutil.rmtree(path)
    for name in (RUN_RECORD, "trainer_state.json"):  # the record and the whole log the run saved at its end
        if (Path(output_dir) / name).is_file():
            (Path(output_dir) / name).unlink()
    if paths:
        logger.warning("overwrite_output_dir: removed the previous run's %s", ", ".join(str(p) for p in paths))


__all__ = [
    "COMPARED_SETTINGS",
    "check_run_directories",
    "clear_previous_run",
    "data_identity",
    "export_record",
    "file_fingerprint",
    "is_draft_export",
    "new_record",
    "resumed_record",
    "run_settings",
    "setting_differences",
]
