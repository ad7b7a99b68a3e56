"""Trainer checkpoints that survive faults (docs/RELIABILITY.md, "Faults and resume").

A checkpoint directory counts as complete only once `COMPLETE_MARKER` is in it; the marker is written last,
after every rank has written its part, and older checkpoints are rotated away only after that. So a save
that is killed, or that fills the disk, leaves a directory that resume never takes for a complete one.
Each rank also writes its data position (`DATA_STATE`) so that a streaming loader can restore itself.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

logger = logging.getLogger("dflash_hf")

COMPLETE_MARKER = "dflash_checkpoint_complete.json"
DATA_STATE = "dflash_data_state_rank{rank}.json"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
# torch.save and safetensors report a full disk in their own words (the errno is lost on the way)
_FULL_DISK_WORDS = ("unexpected pos", "no space left on device", "storagefull", "os error 28", "quota exceeded")


def parse_resume_flag(value: str | bool | None) -> str | bool | None:
    """`resume_from_checkpoint` as given on the command line or in YAML: the strings true/false (any case)
    become booleans, an empty string None; a path stays a path."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("true", "false"):
            return word == "true"
        if not word:
            return None
    return value


def is_complete(checkpoint: str | Path) -> bool:
    return (Path(checkpoint) / COMPLETE_MARKER).is_file()


def mark_complete(checkpoint: str | Path, global_step: int) -> None:
    """Write the completeness marker atomically (temporary file, fsync, rename), then fsync the directory."""
    checkpoint = Path(checkpoint)
    tmp = checkpoint / f".{COMPLETE_MARKER}.tmp"
    with open(tmp, "w") as f:
        json.dump({"global_step": global_step}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, checkpoint / COMPLETE_MARKER)
    _fsync_dir(checkpoint)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """The `checkpoint-N` directories of `output_dir`, newest (highest N) first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def last_complete_checkpoint(output_dir: str | Path) -> tuple[Path | None, list[Path]]:
    """The newest complete checkpoint of `output_dir` (None if there is none) and the incomplete ones newer
    than it (interrupted saves), newest first."""
    skipped = []
    for path in checkpoint_dirs(output_dir):
        if is_complete(path):
            return path, skipped
        skipped.append(path)
    return None, skipped


def resolve_resume_checkpoint(value: str | bool | None, output_dir: str | Path) -> str | None:
    """The checkpoint directory to resume from: `true` = the last complete one in `output_dir` (logged with
    the incomplete ones it skipped), a path = that checkpoint (refused if incomplete), false/None = none."""
    value = parse_resume_flag(value)
    if value is None or value is False:
        return None
    if value is True:
        chosen, skipped = last_complete_checkpoint(output_dir)
        names = [p.name for p in skipped]
        if chosen is None:
            found = f"only incomplete ones {names} (interrupted saves)" if names else "none"
            raise FileNotFoundError(
                f"--resume_from_checkpoint true: no complete checkpoint in output_dir {str(output_dir)!r} (found "
                f"{found}); start without --resume_from_checkpoint or point it at a complete checkpoint directory"
            )
        if skipped:
            logger.warning("resume: skipped incomplete checkpoints %s (interrupted saves)", names)
        logger.warning("resume: resuming from %s", chosen)
        return str(chosen)
    check_checkpoint_dir(value)
    logger.warning("resume: resuming from %s", value)
    return str(value)


def check_checkpoint_dir(path: str | Path) -> None:
    """A checkpoint given by path must exist and be complete."""
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"--resume_from_checkpoint {str(path)!r} is not a directory; give a checkpoint-N directory, or true "
            "for the last complete checkpoint in output_dir"
        )
    if not is_complete(path):
        raise ValueError(
            f"--resume_from_checkpoint {str(path)!r} is incomplete (its save was interrupted, or it was not written "
            f"by dflash_hf: no {COMPLETE_MARKER}); resume from an earlier checkpoint, or pass true for the last "
            "complete one in output_dir"
        )


def save_data_state(checkpoint: str | Path, rank: int, state: dict) -> None:
    path = Path(checkpoint)
    path.mkdir(parents=True, exist_ok=True)
    (path / DATA_STATE.format(rank=rank)).write_text(json.dumps(state))


def load_data_state(checkpoint: str | Path, rank: int, world_size: int) -> dict:
    """This rank's data position from `checkpoint`; refused when it was written with another number of ranks
    (each rank's stream is a different shard, so positions do not carry over)."""
    path = Path(checkpoint) / DATA_STATE.format(rank=rank)
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {str(checkpoint)!r} has no data position for rank {rank} ({path.name}); resume it with "
            "the number of ranks it was written with, or set ignore_data_skip=true to restart the data stream"
        )
    state = json.loads(path.read_text())
    if state.get("world_size", 1) != world_size:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} was written by {state.get('world_size')} ranks, this run has "
            f"{world_size}; resume with the same number of ranks, or set ignore_data_skip=true to restart the "
            "data stream"
        )
    return state


def _is_full_disk(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc).lower()
    return any(w in text for w in _FULL_DISK_WORDS)


@contextmanager
def reporting_full_disk(directory: str | Path) -> Iterator[None]:
    """Re-raise a full disk (OSError ENOSPC / EDQUOT, torch's "unexpected pos", safetensors' StorageFull) as
    `OSError(ENOSPC, "no space left on device while writing <directory>...")`; other errors pass unchanged."""
    try:
        yield
    except Exception as exc:
        if not _is_full_disk(exc):
            raise
        raise OSError(
            errno.ENOSPC,
            f"no space left on device while writing {directory} ({type(exc).__name__}: {exc}); free space there "
            "or set output_dir on a larger disk. The unfinished checkpoint is never used for resume",
        ) from exc


@contextmanager
def complete_only_save(run_dir: str, folder: Path, args, state, accelerator) -> Iterator[None]:
    """Around the Trainer's save of `folder` (in `run_dir`), which writes the marker inside: an interrupted save of
    the same step is removed first; the Trainer's own rotation is held back (`save_total_limit` unset during the
    save), and older checkpoints are rotated away only once every rank is done; a full disk names `folder`."""
    if args.should_save and folder.exists():  # an interrupted save of this step: start it afresh
        shutil.rmtree(folder)
    accelerator.wait_for_everyone()
    limit, args.save_total_limit = args.save_total_limit, None
    try:
        with reporting_full_disk(folder):
            yield
    finally:
        args.save_total_limit = limit
    accelerator.wait_for_everyone()
    if args.should_save:
        rotate_checkpoints(run_dir, limit, state.best_model_checkpoint, use_mtime=True)
