"""The run record, `dflash_run.json`: written by `dflash-train` in its output directory, in every checkpoint and beside
every export (`dflash_hf.training.run_identity` makes it: the run id, the settings the draft is trained with and their
fingerprint); read back to resume a run and, from an export, to tell whether a draft was trained for a given target
(`dflash_hf.export.draft_target`), which the record names by the fingerprint of its weights (`target_identity`)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash_hf.errors import DFlashUserError

RUN_RECORD = "dflash_run.json"


class RunDirectoryError(DFlashUserError):
    """An output or export directory that holds something this run must not write over."""


def target_identity(model) -> dict[str, str]:
    """The frozen target as recorded: where it was loaded from (for messages) and a fingerprint of its weights
    (names, shapes and 64 evenly spaced values of every parameter, in bfloat16 so the training precision does not
    change it). Two targets of the same shapes but other weights differ in it."""
    import torch

    names, samples = [], []
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            names.append(f"{name}:{tuple(param.shape)}")
            if param.device.type == "meta" or hasattr(param, "full_tensor"):
                continue  # offloaded or already sharded: no values here that every rank sees alike
            flat = param.detach().reshape(-1)
            count = min(64, flat.numel())
            index = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)  # exact in int64
            samples.append(flat[index].to(torch.bfloat16).cpu())  # the parameters may sit on several devices
    values = torch.cat(samples).view(torch.int16).numpy().tobytes() if samples else b""
    digest = hashlib.sha256("\n".join(names).encode() + values).hexdigest()[:16]
    return {"name_or_path": str(getattr(model.config, "_name_or_path", "") or ""), "fingerprint": digest}


def read_record(directory: str | Path) -> dict[str, Any] | None:
    """The run record of a run, checkpoint or export directory; None when it has none (written by an older
    dflash_hf); a record that cannot be read names its file."""
    path = Path(directory) / RUN_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunDirectoryError(f"{path} cannot be read ({err}); the run record is damaged: restore it") from err
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
        raise RunDirectoryError(f"{path} is not a dflash_hf run record (no run_id): restore it or remove it")
    return record


def write_record(directory: str | Path, record: Mapping[str, Any], **extra: Any) -> None:
    """Write `record` (plus `extra` fields) to `directory/dflash_run.json` atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{RUN_RECORD}.tmp"
    tmp.write_text(json.dumps(dict(record) | extra, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, directory / RUN_RECORD)


__all__ = ["RUN_RECORD", "RunDirectoryError", "read_record", "target_identity", "write_record"]
