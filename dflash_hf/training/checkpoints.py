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
import pickle
import re
import shutil
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from dflash_hf.errors import EnvironmentFault
from dflash_hf.export.run_record import RUN_RECORD, write_record

logger = logging.getLogger("dflash_hf")

COMPLETE_MARKER = "dflash_checkpoint_complete.json"
DATA_STATE = "dflash_data_state_rank{rank}.json"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
# torch.save and safetensors report a full disk in their own words (the errno is lost on the way)
_FULL_DISK_WORDS = ("unexpected pos", "no space left on device", "storagefull", "os error 28", "quota exceeded")


RESUME_AUTO = "auto"  # resume when the run in output_dir has a complete checkpoint, else start it (requeued jobs)


def parse_resume_flag(value: str | bool | None) -> str | bool | None:
    """`resume_from_checkpoint` as given on the command line or in YAML: the strings true/false (any case)
    become booleans, an empty string None, auto `RESUME_AUTO`; a path stays a path."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("true", "false"):
            return word == "true"
        if word == RESUME_AUTO:
            return RESUME_AUTO
        if not word:
            return None
    return value


def resume_path(value: str | bool | None) -> str | Path | None:
    """The checkpoint directory `resume_from_checkpoint` names (None for true / false / auto / unset)."""
    value = parse_resume_flag(value)
    return value if isinstance(value, (str, Path)) and value != RESUME_AUTO else None


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


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """The Trainer's `checkpoint-N` directory of `step` in `run_dir`."""
    return Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """The `checkpoint-N` directories of `output_dir`, newest (highest N) first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def checkpoint_run_id(checkpoint: str | Path) -> str | None:
    """The run id a checkpoint records (None: written by an older dflash_hf, or no readable record)."""
    try:
        return json.loads((Path(checkpoint) / RUN_RECORD).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def last_complete_checkpoint(
    output_dir: str | Path, run_id: str | None = None, exclude: Collection[Path] = ()
) -> tuple[Path | None, list[Path]]:
    """The newest complete checkpoint of `output_dir` (None if there is none) and the incomplete ones newer
    than it (interrupted saves), newest first. With `run_id`, checkpoints recording another run are passed over;
    those in `exclude` too."""
    skipped = []
    for path in checkpoint_dirs(output_dir):
        if path in exclude or (run_id is not None and checkpoint_run_id(path) not in (run_id, None)):
            continue
        if is_complete(path):
            return path, skipped
        skipped.append(path)
    return None, skipped


# Files the Trainer loads on resume (training_args.bin is not loaded: it is a pickle of the arguments).
_TORCH_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth", "rng_state_*.pth", "pytorch_model.bin")
_JSON_FILES = (
    "trainer_state.json",
    COMPLETE_MARKER,
    "dflash_data_state_rank*.json",
    "dflash_trainable.json",
    RUN_RECORD,
)


def checkpoint_problem(checkpoint: str | Path) -> str | None:
    """Why a complete checkpoint cannot be resumed from (a file missing, truncated, or holding pickled code that
    `weights_only` loading refuses), or None. Reads the files as resume will, tensors memory-mapped."""
    import torch
    from safetensors import safe_open
    from transformers.trainer_pt_utils import safe_globals

    root = Path(checkpoint)
    if not (root / "trainer_state.json").is_file():
        return "trainer_state.json is missing"
    weights = sorted(root.glob("*.safetensors"))
    for path in weights:
        try:
            with safe_open(str(path), "pt") as f:
                f.keys()
        except Exception as err:  # safetensors raises its own error type for a truncated or damaged file
            return f"{path.name} cannot be read ({err})"
    for pattern in _TORCH_FILES:
        for path in sorted(root.glob(pattern)):
            try:
                with safe_globals():  # the numpy RNG state the Trainer allows too
                    torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except pickle.UnpicklingError as err:
                lines = str(err).strip().splitlines()
                first = next((line.strip() for line in lines if "unsupported" in line.lower()), lines[0])[:200]
                return (
                    f"{path.name} holds pickled objects other than tensors ({first}); it was not written by the "
                    "Trainer and is not loaded (unpickling it could run code)"
                )
            except Exception as err:
                return f"{path.name} cannot be read ({type(err).__name__}: {err}; truncated or damaged)"
    sharded = any(p.is_dir() for p in root.iterdir())  # DeepSpeed / FSDP sharded states live in subdirectories
    if not weights and not list(root.glob("pytorch_model*.bin")) and not sharded:
        return "it holds no model weights (model.safetensors)"
    for pattern in _JSON_FILES:
        for path in sorted(root.glob(pattern)):
            try:
                json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, ValueError) as err:
                return f"{path.name} cannot be read ({err}; truncated or damaged)"
    return None


def check_checkpoint_readable(path: str | Path) -> None:
    """A checkpoint given by path must be readable as resume reads it (`checkpoint_problem`)."""
    problem = checkpoint_problem(path)
    if problem:
        raise ValueError(
            f"--resume_from_checkpoint {str(path)!r} is damaged: {problem}; resume from an earlier checkpoint (or "
            "pass true for the last readable one in output_dir)"
        )


def resolve_resume_checkpoint(
    value: str | bool | None, output_dir: str | Path, run_id: str | None = None
) -> str | None:
    """The checkpoint directory to resume from: `true` = the last complete, readable one of run `run_id` (the run
    owning `output_dir`; None: any) in `output_dir`, logged with the incomplete or damaged ones it passed over;
    `auto` = the same when there is a complete one, else none (a new run); a path = that checkpoint (refused if
    incomplete or damaged); false/None = none."""
    value = parse_resume_flag(value)
    if value is None or value is False:
        return None
    if value == RESUME_AUTO:
        if last_complete_checkpoint(output_dir, run_id)[0] is None:
            logger.warning("resume: auto: no complete checkpoint in %s, starting the run", output_dir)
            return None
        value = True
    if value is not True:
        check_checkpoint_dir(value)
        check_checkpoint_readable(value)
        logger.warning("resume: resuming from %s", value)
        return str(value)
    damaged: dict[Path, str] = {}
    while True:
        chosen, skipped = last_complete_checkpoint(output_dir, run_id, exclude=damaged)
        names = [p.name for p in skipped]
        if skipped:
            logger.warning("resume: skipped incomplete checkpoints %s (interrupted saves)", names)
        if chosen is None:
            found = f"only incomplete ones {names} (interrupted saves)" if names else "none"
            found += "; damaged: " + "; ".join(f"{p.name}: {why}" for p, why in damaged.items()) if damaged else ""
            raise FileNotFoundError(
                f"--resume_from_checkpoint true: no complete checkpoint in output_dir {str(output_dir)!r} (found "
                f"{found}); start without --resume_from_checkpoint or point it at a complete checkpoint directory"
            )
        problem = checkpoint_problem(chosen)
        if problem is None:
            break
        damaged[chosen] = problem
        logger.warning("resume: %s is damaged (%s): falling back to the previous complete checkpoint", chosen, problem)
    logger.warning("resume: resuming from %s", chosen)
    return str(chosen)


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


def complete_checkpoint(trainer, folder: Path) -> None:
    """Complete `trainer`'s save of `folder`: each rank's data position, then, once every rank is done, the run record
    and the completeness marker (rank 0); `trainer.finite_guard.last_checkpoint` names it from then on."""
    args = trainer.args
    if trainer.train_position is not None:
        state = trainer.train_position.state_dict() | {"world_size": args.world_size}
        save_data_state(folder, args.process_index, state)
    trainer.accelerator.wait_for_everyone()
    if args.should_save:
        if trainer.run_record is not None:
            write_record(folder, trainer.run_record, global_step=trainer.state.global_step)
        mark_complete(folder, trainer.state.global_step)
    trainer.finite_guard.last_checkpoint = str(folder)


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


def is_full_disk(exc: BaseException) -> bool:
    """Whether `exc` says the disk (or the user's quota) is full, in the errno or in torch's / safetensors' words."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc).lower()
    return any(w in text for w in _FULL_DISK_WORDS)


class DiskFullError(OSError, EnvironmentFault):
    """A full disk (or quota) while writing a checkpoint or the export: an `OSError` with errno ENOSPC and an
    `EnvironmentFault` (exit status 75 from the console scripts)."""

    def __init__(self, what: str, checkpoint: str | None = None):
        OSError.__init__(self, errno.ENOSPC, what)
        self._set_fault(what, checkpoint)

    __str__ = EnvironmentFault.__str__


@contextmanager
def reporting_full_disk(directory: str | Path, what: str = "checkpoint", option: str = "output_dir") -> Iterator[None]:
    """Re-raise a full disk (OSError ENOSPC / EDQUOT, torch's "unexpected pos", safetensors' StorageFull) as a
    `DiskFullError` ("no space left on device while writing <directory>..."); other errors pass unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as exc:
        if not is_full_disk(exc):
            raise
        raise DiskFullError(
            f"no space left on device while writing {directory} ({type(exc).__name__}: {exc}); free space there "
            f"or set {option} on a larger disk. The unfinished {what} is never used"
            + (" for resume" if what == "checkpoint" else "")
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
