"""Exports written atomically: into a hidden sibling directory, renamed into place, the older export kept until the
new one is complete (a kill at any point leaves either the older export whole or no export under that name, and
loading says where the older one is); a directory that is not a draft export is never replaced."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

# Hidden siblings of an export directory `name` while it is written / replaced: `.name.partial-<pid>-<id>` holds the
# new export until it is complete, `.name.previous-<pid>-<id>` the older one between the two renames.
STAGING_KINDS = ("partial", "previous")
RUN_STATE_FILE = re.compile(r"trainer_state\.json|.*\.(bin|pt|pth|ckpt)")  # a run's, never an export's


EXPORT_FILE_MODE = 0o644  # readable by a serving process running as another user


def make_readable(export_dir: Path) -> None:
    """Give every file of an export mode 0644 (safetensors writes weights as 0600)."""
    for path in export_dir.iterdir():
        if path.is_file():
            path.chmod(EXPORT_FILE_MODE)


def staging_siblings(export_dir: Path, kind: str) -> list[Path]:
    """Hidden `kind` siblings (`STAGING_KINDS`) of `export_dir`, newest first."""
    parent = export_dir.parent
    if not parent.is_dir():
        return []
    found = parent.glob(f".{glob.escape(export_dir.name)}.{kind}-*")
    return sorted((p for p in found if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)


def _pid_alive(path: Path) -> bool:
    """Whether the process that named a staging directory `.name.kind-<pid>-<id>` still runs."""
    match = re.search(r"-(\d+)-[0-9a-f]+$", path.name)
    if match is None:
        return False
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_draft_export(directory: Path) -> bool:
    """A directory whose config.json is a DFlash draft's (its `dflash_config`)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("dflash_config"), dict)


def check_replaceable(export_dir: Path) -> None:
    """`export_dir` may be written: absent, empty, or an earlier draft export (a DFlash draft's `config.json`, or none,
    beside plain files that are not a run's training state). Anything else (a target's or another model's directory,
    a run directory, subdirectories) is refused, never replaced."""
    if not export_dir.exists():
        return
    if not export_dir.is_dir():
        raise NotADirectoryError(f"export_dir={str(export_dir)!r} is a file; give a directory for the draft export")
    paths = sorted(export_dir.iterdir())
    reason = None
    if (export_dir / "config.json").exists() and not is_draft_export(export_dir):
        reason = "its config.json is not a DFlash draft's"
    if reason is None:
        others = [p.name for p in paths if not p.is_file() or RUN_STATE_FILE.fullmatch(p.name)]
        if others:
            shown = ", ".join(others[:6]) + (f" and {len(others) - 6} more" if len(others) > 6 else "")
            reason = f"it holds {shown}"
    if reason is not None:
        raise FileExistsError(
            f"export_dir={str(export_dir)!r} exists and is not a DFlash draft export ({reason}); an export replaces "
            "its whole directory: give a new or empty directory"
        )


def write_atomically(export_dir: str | Path, write: Callable[[Path], None]) -> Path:
    """Run `write(staging)` on a new hidden sibling of `export_dir`, then move the result into place: a directory
    that is complete or absent at every instant. An older export there (`check_replaceable`) is kept until the new
    one is complete, then removed. A failed `write` leaves the older export as it was. Stale staging directories
    of dead processes are removed first. Returns `export_dir`."""
    given = Path(export_dir)
    export_dir = Path(os.path.abspath(given))
    if export_dir.exists() and os.path.samefile(export_dir, os.getcwd()):
        raise ValueError(
            f"export_dir={str(given)!r} is the current directory; an export replaces its whole directory: give a "
            "subdirectory (e.g. ./draft)"
        )
    check_replaceable(export_dir)
    export_dir.parent.mkdir(parents=True, exist_ok=True)
    for kind in STAGING_KINDS:
        for stale in staging_siblings(export_dir, kind):
            if not _pid_alive(stale) and (kind == "partial" or export_dir.exists()):
                shutil.rmtree(stale, ignore_errors=True)
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging = export_dir.parent / f".{export_dir.name}.partial-{token}"
    staging.mkdir()
    try:
        write(staging)
        make_readable(staging)
        staging.chmod(0o755)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    previous = None
    if export_dir.exists():
        previous = export_dir.parent / f".{export_dir.name}.previous-{token}"
        os.rename(export_dir, previous)
    os.rename(staging, export_dir)
    for old in [previous, *staging_siblings(export_dir, "previous")]:
        if old is not None and (old == previous or not _pid_alive(old)):
            shutil.rmtree(old, ignore_errors=True)
    return given
