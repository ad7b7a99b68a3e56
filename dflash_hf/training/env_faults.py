"""Environment faults during training (docs/RELIABILITY.md, "Environment faults"): a full disk, a data-loader worker
killed (the kernel's out-of-memory killer picks audio workers first), GPU out of memory in a step.

Each ends in one `EnvironmentFault` (exit status 75 from `dflash-train`): what happened, the last complete checkpoint
and the command that resumes. Where the run's state allows it (one process; the training loop runs; the fault came
before the optimizer update or after the step ended), a complete checkpoint is saved first at the step boundary, as a
stop signal does, so nothing is lost beyond the current step. After the loop (the best checkpoint loaded by
`load_best_model_at_end`, the final evaluation, the export) the weights need not be the last step's: a fault there
only names the last complete checkpoint, which is the last step's (`training_end.save_last_step`) unless
`save_strategy` is no; a resume from it trains no step where training had ended (`EnvironmentFault.ended`).
:class:`StepFaults` knows where in the step the run is:

- *step*: from the fetch of the step's micro-batches to the optimizer update. Weights and optimizer are those of the
  step boundary; the data position is restored to the one taken when the step began, the gradients are dropped.
- *update*: the optimizer update, until the step ends. A fault here may have updated part of the weights: nothing is
  saved. The loader's worker-death signal (SIGCHLD, which PyTorch turns into an exception wherever the main thread
  is) is held back during it and acted on right after, at the boundary.
- *boundary*: after the step ended (logging, evaluation, saving): the state and the data position are the step's.

`--skip_oom_batches N` skips up to N optimizer steps whose micro-batch ran out of GPU memory: the step's gradients are
dropped and the optimizer does not update (the learning-rate schedule and `global_step` move on), each skip is logged,
counted in the logs (`skipped_oom_batches`) and the final metrics, and recorded in the run record of every checkpoint.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import TrainerCallback

from dflash_hf.data.epochs import ResumableEpochs
from dflash_hf.errors import EnvironmentFault, debug_enabled, oom_reason
from dflash_hf.training.assembly import is_speech_source
from dflash_hf.training.checkpoints import (
    DiskFullError,
    checkpoint_dir,
    is_complete,
    is_full_disk,
    last_complete_checkpoint,
)
from dflash_hf.training.training_end import resume_trains_no_step

logger = logging.getLogger("dflash_hf")

STEP, UPDATE, BOUNDARY = "step", "update", "boundary"
SKIPPED_KEY = "skipped_oom_batches"  # run record entry (every checkpoint) and log / metrics name
_WORKER_DIED = "DataLoader worker (pid"  # PyTorch's words for a worker process that died or was killed
_LOADER_FILE = os.path.join("torch", "utils", "data", "dataloader.py")
_LOADER_RECEIVE = ("_try_get_data", "_get_data", "_next_data")  # where the main process receives a batch


class StepFaults:
    """Where the trainer is in its optimizer step, the OOM skips (`--skip_oom_batches`) and the conversion of an
    environment fault into an `EnvironmentFault` (see the module). `trainer`: the `DFlashTrainer`."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.limit = trainer.args.skip_oom_batches
        self.phase = BOUNDARY
        self.in_loop = False  # the training loop runs: weights, optimizer and data position are its step's
        self.micro = 0  # micro-batches started in this step
        self._position: dict | None = None  # the data position when the step began
        self._sums = None  # the training metric sums when the step began (restored when the step is skipped)
        self._skipping = False  # this step lost a micro-batch to OOM: its other micro-batches are not run
        self._held: tuple[Callable, list] | None = None  # SIGCHLD handler held back during the update
        self._local: list[dict] = []  # skips when the trainer has no run record (outside `train`)
        self.oom_shape: str | None = None  # the micro-batch that ran out of memory last, for the message
        self.callback = _StepEnd(self)

    @property
    def skipped(self) -> list[dict]:
        """The skipped steps of this run (kept in the run record: restored on resume)."""
        record = self.trainer.run_record
        return record.setdefault(SKIPPED_KEY, []) if record is not None else self._local

    # --- phases
    def step_started(self) -> None:
        """The step's micro-batches are about to be fetched (`get_batch_samples`)."""
        position = self.trainer.train_position
        self._position = ResumableEpochs.state_dict(position) if position is not None else None  # no skip list
        if self.limit:
            sums = self.trainer.train_sums
            self._sums = dataclasses.replace(sums, values=dict(sums.values))
        self._skipping, self.micro = False, 0
        self.phase = STEP

    def update_started(self) -> None:
        """Right before the optimizer update (`_get_grad_norm`)."""
        self.phase = UPDATE
        self._hold_worker_signals()

    def step_ended(self) -> None:
        self.phase = BOUNDARY
        self._release_worker_signals(replay=True)

    def _hold_worker_signals(self) -> None:
        sigchld = getattr(signal, "SIGCHLD", None)
        if sigchld is None or threading.current_thread() is not threading.main_thread():
            return
        handler = signal.getsignal(sigchld)
        if callable(handler):  # PyTorch's, installed while loader workers run
            pending: list = []
            signal.signal(sigchld, lambda signum, frame: pending.append(signum))
            self._held = (handler, pending)

    def _release_worker_signals(self, replay: bool) -> None:
        if self._held is None:
            return
        handler, pending = self._held
        self._held = None
        signal.signal(signal.SIGCHLD, handler)
        if pending and replay:
            handler(signal.SIGCHLD, None)  # raises here, at the boundary, if a worker died

    # --- GPU out of memory in a micro-batch
    def micro_batch(self, run: Callable, model, inputs: dict, num_items, plan=None) -> torch.Tensor:
        """`run(model, inputs, num_items)` (the Trainer's training step); on GPU out of memory, skip the step when
        `--skip_oom_batches` allows it, else let the error end the run (`handled` names the micro-batch)."""
        self.micro += 1
        if self._skipping:
            return torch.zeros((), device=self.trainer.args.device)
        try:
            return run(model, inputs, num_items)
        except torch.OutOfMemoryError:
            self.oom_shape = micro_batch_shape(inputs, plan, self.micro, self.trainer)
            if len(self.skipped) >= self.limit:
                raise
        # out of the except block: the failed forward's tensors are free now
        self._skip_step(model)
        return torch.zeros((), device=self.trainer.args.device)

    def _skip_step(self, model) -> None:
        self._skipping = True
        model.zero_grad(set_to_none=True)  # no gradient: the optimizer leaves every parameter as it is
        if self._sums is not None:
            self.trainer.train_sums = self._sums  # the step's metrics leave with it
        release_device_memory()
        step = self.trainer.state.global_step + 1
        self.skipped.append({"step": step, "micro_batch": self.oom_shape})
        logger.warning(
            "GPU out of memory in optimizer step %d, %s: the step is skipped (its gradients dropped, the optimizer "
            "not updated; %d of --skip_oom_batches %d used)",
            step,
            self.oom_shape,
            len(self.skipped),
            self.limit,
        )

    def log_entries(self) -> dict[str, int]:
        """`skipped_oom_batches` (with `--skip_oom_batches`): the steps skipped so far in this run."""
        return {SKIPPED_KEY: len(self.skipped)} if self.limit else {}

    def annotate(self, logs: dict, sums) -> None:
        """A training log entry gets `log_entries`; one whose window trained no micro-batch (every step skipped)
        has no loss or gradient norm to report (the Trainer's would be the skipped steps' zeros)."""
        if not self.limit or "loss" not in logs:
            return
        logs.update(self.log_entries())
        if not sums.values:
            logs.pop("loss", None)
            logs.pop("grad_norm", None)

    def report(self, metrics: dict) -> None:
        """At the end of training: `skipped_oom_batches` in `metrics` (with `--skip_oom_batches`), the list logged."""
        metrics.update(self.log_entries())
        if self.summary():
            logger.warning(self.summary())

    def summary(self) -> str | None:
        """One line listing the skipped steps (None when none was)."""
        if not self.skipped:
            return None
        steps = "; ".join(f"step {s['step']} ({s['micro_batch']})" for s in self.skipped)
        return f"skipped {len(self.skipped)} optimizer steps that ran out of GPU memory: {steps}"

    # --- faults
    @contextmanager
    def handled(self) -> Iterator[None]:
        """Around training (and the export): an environment fault becomes an `EnvironmentFault` naming the last
        complete checkpoint, after a checkpoint is saved at the step boundary where the state allows it."""
        try:
            yield
        except EnvironmentFault as err:
            self._release_worker_signals(replay=False)
            if err.checkpoint is None:
                self._name_checkpoint(err)
            raise
        except Exception as err:  # noqa: BLE001 - what is not an environment fault is raised as it is
            self._release_worker_signals(replay=False)
            with _worker_signals_ignored():  # a dead worker's signal must not raise again while this is handled
                fault = self._fault(err)
                if fault is None:
                    raise
                if debug_enabled():
                    fault.add_note("".join(traceback.format_exception(err)))
                traceback.clear_frames(err.__traceback__)  # the failed step's tensors and broken loader go now
                release_device_memory()
                self._save_or_name_checkpoint(fault)
            raise fault from None
        finally:
            self._release_worker_signals(replay=False)

    def _fault(self, err: Exception) -> EnvironmentFault | None:
        args = self.trainer.args
        if is_full_disk(err):
            return DiskFullError(
                f"no space left on device ({type(err).__name__}: {err}); free space there or set output_dir on a "
                "larger disk"
            )
        died = worker_death(err)
        if died:
            return EnvironmentFault(
                f"a data-loader worker died ({died}). Most often the kernel's "
                "out-of-memory killer stopped it (check `dmesg`): the workers hold decoded audio and features in host "
                f"memory. Lower --dataloader_num_workers (now {args.dataloader_num_workers}) or the batch's token "
                "budget, or give the job more host memory (or shared memory, /dev/shm, for a bus error)"
            )
        if isinstance(err, torch.OutOfMemoryError):
            return EnvironmentFault(oom_message(self, str(err)))
        return None

    def _save_or_name_checkpoint(self, fault: EnvironmentFault) -> None:
        """Save a complete checkpoint at the step boundary when the state allows it, else name the last one. Only
        inside the training loop (`in_loop`): after it the weights may be the best checkpoint's, not the step's."""
        trainer = self.trainer
        if not self.in_loop or isinstance(fault, DiskFullError) or self.phase == UPDATE or trainer.args.world_size > 1:
            self._name_checkpoint(fault)
            return
        step = trainer.state.global_step
        folder = checkpoint_dir(trainer._get_output_dir(trial=None), step)
        if step == 0 or is_complete(folder):
            fault.checkpoint = self.last_checkpoint()
            return
        try:
            if self.phase == STEP and self._position is not None:
                trainer.train_position.load_state_dict(self._position)  # the batches of the step, again
            trainer.model.zero_grad(set_to_none=True)
            trainer._save_checkpoint(trainer.model, trial=None)
        except Exception as err:  # noqa: BLE001 - the fault is reported either way; this failure is logged
            logger.warning("no checkpoint saved at step %d after the fault (%s: %s)", step, type(err).__name__, err)
            fault.checkpoint = self.last_checkpoint()
            return
        fault.checkpoint, fault.saved = str(folder), True

    def _name_checkpoint(self, fault: EnvironmentFault) -> None:
        """The last complete checkpoint; outside the training loop, one of the run's present step is `saved` where
        the run stopped, and `ended` when a resume from it trains no step (training ended at it)."""
        fault.checkpoint = self.last_checkpoint()
        state = self.trainer.state
        present = checkpoint_dir(".", state.global_step).name
        if self.in_loop or fault.checkpoint is None or Path(fault.checkpoint).name != present:
            return
        patience = self.trainer.args.early_stopping_patience
        fault.saved, fault.ended = True, resume_trains_no_step(fault.checkpoint, state.max_steps, patience)

    def last_checkpoint(self) -> str | None:
        """The run's last complete checkpoint (None: none yet)."""
        record = self.trainer.run_record
        found, _ = last_complete_checkpoint(self.trainer.args.output_dir, record and record.get("run_id"))
        return str(found) if found is not None else self.trainer.finite_guard.last_checkpoint


class _StepEnd(TrainerCallback):
    def __init__(self, faults: StepFaults):
        self.faults = faults

    def on_train_begin(self, args, state, control, **kwargs):
        self.faults.phase = BOUNDARY
        self.faults.in_loop = True  # cleared when the best checkpoint is loaded and when `train` returns

    def on_step_end(self, args, state, control, **kwargs):
        self.faults.step_ended()


@contextmanager
def _worker_signals_ignored() -> Iterator[None]:
    """SIGCHLD left to its default while a fault is handled (PyTorch's handler would raise again for the dead worker,
    or for other workers exiting while the checkpoint is saved)."""
    sigchld = getattr(signal, "SIGCHLD", None)
    if sigchld is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(sigchld, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(sigchld, previous)


def worker_death(err: BaseException) -> str | None:
    """How PyTorch said that a loader worker died, or None. It says so itself (`DataLoader worker (pid N) is killed by
    signal: Killed`, `... exited unexpectedly`), or the main process loses the connection to the dead worker while
    it receives a batch the worker had sent (tensors are passed through the worker's file-descriptor server)."""
    text = str(err).strip()
    if isinstance(err, RuntimeError) and _WORKER_DIED in text:
        return text.splitlines()[0]
    if isinstance(err, (ConnectionError, EOFError)):
        codes = [frame.f_code for frame, _ in traceback.walk_tb(err.__traceback__)]  # no source file read
        if any(c.co_filename.endswith(_LOADER_FILE) and c.co_name in _LOADER_RECEIVE for c in codes):
            return f"{type(err).__name__} while receiving a batch from a worker: {text or 'connection lost'}"
    return None


def release_device_memory() -> None:
    """Free what a failed step left: unreachable tensors, then the allocator's cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def micro_batch_shape(inputs: dict, plan, index: int, trainer) -> str:
    """`micro-batch 2 of 4: 8 rows, 8 x 512 = 4096 tokens, 4096 anchors of block size 16` (what the step held)."""
    accumulation = getattr(trainer, "current_gradient_accumulation_steps", trainer.args.gradient_accumulation_steps)
    parts = [f"micro-batch {index} of {accumulation}"]
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        rows, length = ids.shape
        parts.append(f"{rows} rows, {rows} x {length} = {rows * length} tokens")
    anchors = getattr(plan, "anchors", None)
    if isinstance(anchors, torch.Tensor):
        parts.append(f"{anchors.numel()} anchors of block size {trainer.objective.block_size}")
    return ": ".join([parts[0], ", ".join(parts[1:])]) if len(parts) > 1 else parts[0]


def memory_options(args, data_args, speech: bool) -> str:
    """The options that lower a training step's GPU memory, with their current values."""
    options = []
    if args.packing:
        options.append(f"--packing_max_tokens (now {args.packing_max_tokens}; the token budget of a packed row)")
        options.append(f"--anchor_budget (now {args.anchor_budget}; anchors of a packed micro-batch)")
    elif speech:
        options.append(f"--max_tokens (now {data_args.max_tokens}; the token budget of a batch: rows x longest sample)")
        options.append(f"--max_batch_size (now {data_args.max_batch_size}; rows of a batch)")
    else:
        options.append(f"--per_device_train_batch_size (now {args.per_device_train_batch_size})")
    options.append(f"--num_anchors (now {args.num_anchors}; blocks per row)")
    checkpointing = next(n for n in ("activation_checkpointing", "gradient_checkpointing") if hasattr(args, n))
    if not getattr(args, checkpointing, False):
        options.append(f"--{checkpointing} true (recompute the draft's activations in backward)")
    options.append(f"--ce_chunk_size (now {args.ce_chunk_size}; draft slots projected to the vocabulary at once)")
    options.append(f"--target_argmax_chunk_size (now {args.target_argmax_chunk_size})")
    if args.precision == "fp32":
        options.append("--precision bf16")
    if args.target_cuda_graph is not False:
        options.append("--target_cuda_graph false (the graphs keep their buffers allocated)")
    return ", ".join(options)


def oom_message(faults: StepFaults, error: str) -> str:
    """What ran out of GPU memory (the micro-batch's shape), the options that lower it, and `--skip_oom_batches`."""
    trainer = faults.trainer
    step = trainer.state.global_step + (faults.phase != BOUNDARY)
    if faults.phase == STEP and faults.oom_shape:
        where = f"in optimizer step {step}, {faults.oom_shape}"
    elif faults.phase == UPDATE:
        where = f"in the optimizer update of step {step} (the optimizer's state is allocated at the first update)"
    else:
        where = f"after optimizer step {step} (evaluation, logging or a checkpoint save)"
    lower = memory_options(trainer.args, trainer.data_args, is_speech_source(trainer.train_dataset))
    skip = (
        f"{len(faults.skipped)} steps were skipped already, as many as --skip_oom_batches {faults.limit} allows"
        if faults.limit
        else "or let --skip_oom_batches N skip up to N such steps (each logged and counted)"
    )
    return f"GPU out of memory {where} ({oom_reason(error)}). Lower the memory a step needs: {lower}; {skip}"


__all__ = ["SKIPPED_KEY", "StepFaults", "memory_options", "micro_batch_shape", "oom_message"]
