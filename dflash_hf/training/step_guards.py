"""Guards around the optimizer step (docs/RELIABILITY.md, "Run directories, resume and faults").

- :class:`FiniteStepGuard`: a non-finite loss or gradient norm stops training with :class:`NonFiniteStepError`
  naming the optimizer step. On the CPU (and under DeepSpeed, whose norm is a float) the step is checked before
  the optimizer takes it, so the optimizer never sees it. On a GPU the verdict is copied to the host behind the
  step's work and read one step later (no host sync per step), and at once before any checkpoint is saved and
  before the export: a poisoned step may reach the draft in memory, never a checkpoint or an export.
- :class:`StopSignals`: SIGTERM and SIGINT (what SLURM and Kubernetes send before preemption) ask the run to save
  a complete checkpoint at the next optimizer-step boundary and stop; :class:`TrainingInterrupted` then says where.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from dflash_hf.errors import DFlashUserError
from dflash_hf.training.checkpoints import checkpoint_dir

logger = logging.getLogger("dflash_hf")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class NonFiniteStepError(DFlashUserError):
    """A training step whose loss or gradient norm is NaN or infinite."""


class TrainingInterrupted(Exception):
    """Training stopped on SIGTERM / SIGINT after saving a complete checkpoint (`saved`; else `checkpoint` is the
    last complete one: the weights were no longer the step's); `exit_code` is 128 + the signal."""

    def __init__(self, signum: int, step: int, checkpoint: str | None, saved: bool = True):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum
        if checkpoint is None:
            where = "no checkpoint saved (save_strategy or an earlier error)"
        elif saved:
            where = f"saved {checkpoint}"
        else:
            where = f"none saved at this step (the best checkpoint was loaded); the last complete one is {checkpoint}"
        super().__init__(
            f"received {signal.Signals(signum).name}: stopped at optimizer step {step}, {where}; the draft was not "
            "exported. Resume with --resume_from_checkpoint true (same command): it continues bit for bit"
        )


class FiniteStepGuard:
    """Checks each optimizer step's summed micro-batch loss and gradient norm for NaN / inf (see the module)."""

    def __init__(self, check_loss: bool = True):
        self.check_loss = check_loss  # DDP: the loss is this rank's, the norm all ranks'; only the norm is agreed
        self._loss: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None, int] | None = None
        self.last_checkpoint: str | None = None  # named in the error: where to resume from

    def add_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's (detached) loss of the step being accumulated."""
        if self.check_loss:
            loss = loss.detach().float().reshape(())
            self._loss = loss if self._loss is None else self._loss + loss

    def observe(self, grad_norm, step: int) -> None:
        """Before optimizer step `step`: this step's gradient norm (a tensor, or a float under DeepSpeed)."""
        loss, self._loss = self._loss, None
        if grad_norm is None:
            return
        if hasattr(grad_norm, "full_tensor"):  # FSDP2 may return the norm as a DTensor (every rank gets here)
            grad_norm = grad_norm.full_tensor()
        if not isinstance(grad_norm, torch.Tensor) or grad_norm.device.type != "cuda":
            norm = float(grad_norm)
            self._check(float(loss) if loss is not None else 0.0, norm, step, applied=False)
            return
        self.settle()  # the previous step's verdict: long copied by now
        values = torch.stack([loss if loss is not None else torch.zeros((), device=grad_norm.device), grad_norm])
        host = torch.empty(2, pin_memory=True)
        host.copy_(values.float(), non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(grad_norm.device))
        self._pending = (host, done, step)

    def settle(self) -> None:
        """Check the step whose verdict is still on its way (before a save, the export and the end of training)."""
        if self._pending is None:
            return
        host, done, step = self._pending
        self._pending = None
        if done is not None:
            done.synchronize()
        loss, norm = host.tolist()
        self._check(loss, norm, step, applied=True)

    def _check(self, loss: float, norm: float, step: int, applied: bool) -> None:
        if math.isfinite(loss) and math.isfinite(norm):
            return
        what = " and ".join(n for n, v in (("loss", loss), ("gradient norm", norm)) if not math.isfinite(v))
        where = self.last_checkpoint
        effect = (
            "the step reached the draft in memory, which is neither saved nor exported"
            if applied
            else "the optimizer did not take the step"
        )
        raise NonFiniteStepError(
            f"non-finite {what} at optimizer step {step} (loss {loss}, gradient norm {norm}): training stopped and "
            f"{effect}. Likely causes: a sample with non-finite or extreme audio values or labels (check the data, or "
            "--skip_bad_samples true), or a learning rate too high. "
            + (
                f"The last complete checkpoint is {where}: fix the cause, then resume (--resume_from_checkpoint true)"
                if where
                else "No checkpoint was saved yet: fix the cause and start again"
            )
        )


class StopSignals:
    """Records SIGTERM / SIGINT while installed (`installed()`); the first one restores the previous handler, so a
    second signal acts as it would without this (SIGINT: KeyboardInterrupt)."""

    def __init__(self):
        self.signum: int | None = None

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
        logger.warning(
            "received %s: saving a complete checkpoint at the end of this optimizer step, then stopping "
            "(send it again to stop at once, without a checkpoint)",
            signal.Signals(signum).name,
        )

    @contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """Install the handlers (in the main thread only: elsewhere signals cannot be handled) for the block."""
        self.signum = None
        self._previous = {}
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        try:
            yield self
        finally:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)

    def after_training(
        self, output_dir: str, step: int, save: Callable[[], None] | None, faults
    ) -> TrainingInterrupted:
        """The stop of a signal that training ended on, naming the checkpoint of the last `step`: saved now by `save`
        if the signal came after it (e.g. during the final evaluation) while the weights are still that step's (None
        after the best checkpoint was loaded by `load_best_model_at_end`: they are not, and the last complete
        checkpoint, `faults.last_checkpoint()`, is named instead)."""
        saved = checkpoint_dir(output_dir, step)
        if not saved.is_dir() and save is None:
            return TrainingInterrupted(self.signum, step, faults.last_checkpoint(), saved=False)
        if not saved.is_dir():
            save()
        return TrainingInterrupted(self.signum, step, str(saved), saved=True)


__all__ = ["FiniteStepGuard", "NonFiniteStepError", "StopSignals", "TrainingInterrupted"]
