"""Trainer callbacks: real acceptance length during training, a concise progress bar (docs/EVALUATION.md) and the
data epoch of a loader without a length."""

from __future__ import annotations

import math
import time

import torch
from transformers import DefaultFlowCallback, ProgressCallback, TrainerCallback
from transformers.utils import logging

from dflash_hf.training.best_model import add_early_stopping
from dflash_hf.training.estimates import RealTau

logger = logging.get_logger(__name__)


class RealTauCallback(TrainerCallback):
    """Every `real_tau_steps` optimizer steps, decode `real_tau_samples` prompts of each validation set
    (the part of a row before its first supervised token) with `speculative_generate` and log the real
    acceptance length through `Trainer.log` (so every `report_to` logger gets it): `eval_tau` for a single
    validation set, `eval_{name}_tau` for named sets, beside `eval_*_tau_est` (`estimates.RealTau`). Not at a step
    whose evaluation reports it already (`eval_real_tau`): the same prompts are not decoded twice. Registered after
    the callbacks that decide this step's evaluation (the Trainer's flow, `DataEpochCallback`)."""

    def __init__(self, trainer):
        args = trainer.args
        if trainer.eval_dataset is None:
            raise ValueError(
                f"real_tau_steps={args.real_tau_steps} decodes validation prompts: pass eval_dataset to the "
                "trainer, or set real_tau_steps=0"
            )
        self.trainer = trainer

    def sets(self) -> list[tuple[str, object]]:
        """(metric prefix, dataset) of every validation set."""
        tr = self.trainer
        if isinstance(tr.eval_dataset, dict):
            return [(f"eval_{name}_", dataset) for name, dataset in tr.eval_dataset.items()]
        return [("eval_", tr.eval_dataset)]

    def prompts(self) -> dict[str, list[dict]]:
        """Metric prefix -> prompts, collected once with the trainer's collator."""
        return {prefix: self.trainer.real_tau.prompts(dataset, prefix[5:-1] or None) for prefix, dataset in self.sets()}

    def measure(self) -> dict[str, float]:
        """`{prefix}tau` per validation set (mean accepted tokens + 1 over all draft/verify cycles)."""
        taus = {f"{prefix}tau": self.trainer.real_tau(dataset, prefix[5:-1] or None) for prefix, dataset in self.sets()}
        return {k: v for k, v in taus.items() if math.isfinite(v)}  # no cycle ran: nothing to report

    def on_step_end(self, args, state, control, **kwargs):
        if args.real_tau_steps > 0 and state.global_step % args.real_tau_steps == 0:
            if args.eval_real_tau and control.should_evaluate:
                return control  # this step's evaluation decodes the same prompts and reports `eval_*tau` itself
            metrics = self.measure()
            if metrics:
                should_log = control.should_log  # Trainer.log clears it; keep this step's training log
                self.trainer.log(metrics)
                control.should_log = should_log
        return control


class AgreedFlag:
    """A verdict every rank agrees on without waiting for the device. On one process it is the verdict itself. Under
    DDP (two or more ranks) it is the ranks' maximum of the previous step's verdicts (False at the first): this step's
    is filled on the device (no host copy: `torch.tensor(..., device=)` would wait for the stream), all-reduced in the
    stream's order and copied to pinned host memory behind the step's work, with an event; reading it a step later
    waits for nothing on a GPU (an `.item()` here would drain the device every step)."""

    def __init__(self):
        self.pending = None  # the last step's verdict being reduced: (host copy, its CUDA event or None)

    def reset(self) -> None:
        self.pending = None

    def __call__(self, verdict: bool, device: torch.device) -> bool:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return verdict
        value = torch.full((1,), float(verdict), device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        host = torch.empty(1, pin_memory=device.type == "cuda")
        host.copy_(value, non_blocking=True)
        done = None
        if device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
        previous, self.pending = self.pending, (host, done)
        if previous is None:
            return False
        if previous[1] is not None:
            previous[1].synchronize()
        return bool(previous[0].item() > 0)


class TimeBudgetCallback(TrainerCallback):
    """`max_train_minutes`: after the optimizer step that crosses the budget, stop, save a checkpoint and let the
    run export as at `max_steps`. Under DDP the ranks agree on the maximum of their verdicts, read one step later
    (`AgreedFlag`), so every rank stops at the same step, the one after the crossing."""

    def __init__(self, minutes: float):  # checked > 0 by DFlashTrainingArguments
        self.seconds = 60.0 * minutes
        self.start = None
        self.agreed = AgreedFlag()

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.monotonic()
        self.agreed.reset()

    def on_step_end(self, args, state, control, **kwargs):
        over = self.agreed(time.monotonic() - self.start >= self.seconds, args.device)
        if over and not control.should_training_stop:
            logger.warning(
                "max_train_minutes=%g reached at step %d of %d: stopping, saving and exporting",
                self.seconds / 60,
                state.global_step,
                state.max_steps,
            )
            control.should_training_stop = True
            control.should_save = args.save_strategy != "no"


class StopSignalCallback(TrainerCallback):
    """SIGTERM / SIGINT (`step_guards.StopSignals`): at the end of the optimizer step in which the signal came (under
    DDP: the step after, agreed by every rank), save a complete checkpoint and stop. `stopped_at` is that step."""

    def __init__(self, signals):
        self.signals = signals
        self.agreed = AgreedFlag()
        self.stopped_at: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.agreed.reset()
        self.stopped_at = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.agreed(self.signals.signum is not None, args.device) and self.stopped_at is None:
            self.stopped_at = state.global_step
            logger.warning("stop signal: saving a complete checkpoint at step %d and stopping", state.global_step)
            control.should_training_stop = True
            control.should_save = True
        return control


class LabelAgreementCallback(TrainerCallback):
    """Warn once per metric when `target_agreement` (train) or `eval_<name>_target_agreement` is below `threshold`:
    the target's own next token differs from the data's at many of the positions it labels, so the draft trains on
    sequences the target does not write, or (a validation set, whatever the label source) every teacher-forced estimate
    of that set is taken in contexts the target never reaches (docs/GENERATED_LABELS.md says what to do)."""

    def __init__(self, threshold: float = 0.9):
        self.threshold = threshold
        self.warned: set[str] = set()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:  # every rank logs the same reduced value: one warning is enough
            return
        for name, value in (logs or {}).items():
            if not name.endswith("target_agreement") or value >= self.threshold or name in self.warned:
                continue
            self.warned.add(name)
            prefix = name[: -len("target_agreement")]
            if name.startswith("eval_"):
                consequence = (
                    f"so {prefix}tau_est (and {prefix}greedy_tau_est, {prefix}greedy_walk_tau_est) is measured on "
                    "sequences the target never writes, and can be far from the real tau, above or below it"
                )
                fix = (
                    f"Pick drafts by {prefix}tau (real speculative decoding of the set's prompts, --eval_real_tau "
                    "true), and validate on the target's own outputs: run dflash-generate-labels on the validation "
                    "manifest too (docs/GENERATED_LABELS.md)."
                )
            else:
                consequence = "so the draft learns from sequences the target never writes"
                fix = (
                    "Use the target's own outputs instead: dflash-generate-labels, then --label_source ground_truth "
                    "(docs/GENERATED_LABELS.md)."
                )
            logger.warning(
                "%s = %.3f at step %d: the target's greedy next token differs from the data token at %.1f%% of the "
                "positions it labels (references normalized otherwise than the target's output: punctuation, "
                "casing, numbers; a tokenizer that encodes the text otherwise than the target writes it; or a target "
                "that does not yet know this data), %s. %s",
                name,
                value,
                state.global_step,
                100 * (1 - value),
                consequence,
                fix,
            )


class LoaderPaceCallback(TrainerCallback):
    """Warn once when the training step waits for its batches more than `share` of its wall time (`data_wait_ms`
    against `step_ms`, logged by `DFlashTrainer`): the loader, not the device, sets the pace. The first logging
    window is left out (the loader's start and compilation fall in it)."""

    def __init__(self, share: float = 0.3):
        self.share = share
        self.windows = 0
        self.warned = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.warned or not logs or "data_wait_ms" not in logs or not state.is_world_process_zero:
            return
        self.windows += 1
        wait, step = logs["data_wait_ms"], logs.get("step_ms", 0.0)
        if self.windows == 1 or step <= 0 or wait <= self.share * step:
            return
        self.warned = True
        workers = args.dataloader_num_workers
        where = (
            "the batches are rendered, tokenized and featurized in the training process"
            if workers == 0
            else f"{workers} loader workers do not keep up"
        )
        logger.warning(
            "the data loader sets the pace: at step %d a step waited %.0f of its %.0f ms for its batches (%s). Raise "
            "--dataloader_num_workers (now %d; a few per GPU, up to the CPU cores there are). What stays in the "
            "training process is the sampler's token counting, once per sample (docs/PERFORMANCE.md, \"The data "
            'loader").',
            state.global_step,
            wait,
            step,
            where,
            workers,
        )


class DFlashProgressCallback(ProgressCallback):
    """The Trainer's progress bar with `loss`, `tau_est` (and the real `tau` when measured) as its postfix,
    instead of printing the whole log dict at every logging step; evaluation results print as one line."""

    def __init__(self, max_str_len: int = 100):
        super().__init__(max_str_len)
        self.postfix: dict[str, str] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        if "loss" in logs:
            self.postfix.update({k: f"{logs[k]:.4g}" for k in ("loss", "tau_est") if k in logs})
        # real tau: eval_tau -> tau, eval_{name}_tau -> {name}_tau
        self.postfix.update(
            {k[len("eval_") :]: f"{v:.3g}" for k, v in logs.items() if k.startswith("eval_") and k.endswith("_tau")}
        )
        self.training_bar.set_postfix(self.postfix, refresh=False)
        evals = {k: v for k, v in logs.items() if k.startswith("eval_") and k.endswith(("_loss", "_tau_est", "_tau"))}
        if any(k.endswith(("_loss", "_tau_est")) for k in evals):  # an evaluation: its real tau first
            order = sorted(evals, key=lambda k: (not k.endswith("_tau"), k))
            self.training_bar.write(f"step {state.global_step}: " + ", ".join(f"{k}={evals[k]:.4g}" for k in order))
        elif "train_runtime" in logs:
            self.training_bar.write(", ".join(f"{k}={v:.4g}" for k, v in logs.items() if isinstance(v, float)))


class TrainClockCallback(TrainerCallback):
    """Starts the trainer's `TrainClock` when the training loop begins (after a resumed checkpoint's log is loaded)."""

    def __init__(self, clock):
        self.clock = clock

    def on_train_begin(self, args, state, control, **kwargs):
        self.clock.begin(state.log_history)


class DataEpochCallback(TrainerCallback):
    """The Trainer sees a loader without a length as one endless epoch (`EpochStream`); this callback logs the
    data epoch as `epoch` (monotonic across resumes) and applies the `epoch` logging / evaluation / save
    strategies at the step in which a data epoch ends. `trainer`: the `DFlashTrainer` (its `train_position`)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.epochs_done = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.epochs_done = int(state.epoch or 0)

    def on_step_end(self, args, state, control, **kwargs):
        position = self.trainer.train_position
        if position is None:
            return control
        state.epoch = position.epoch_progress
        if int(state.epoch) > self.epochs_done:
            self.epochs_done = int(state.epoch)
            return DefaultFlowCallback().on_epoch_end(args, state, control)
        return control


def add_dflash_callbacks(trainer, args) -> None:
    """The `DFlashTrainer`'s callbacks: the concise progress bar, real tau (`real_tau_steps`), the data epoch, the
    label-agreement and loader-pace warnings, the time budget (`max_train_minutes`), the stop on SIGTERM / SIGINT
    (`trainer.stop_signals`) and early stopping (`early_stopping_patience`)."""
    use_concise_progress_bar(trainer)
    trainer.real_tau = RealTau(trainer)  # `eval_<set>_tau`: in every evaluation (`eval_real_tau`) and here
    trainer.add_callback(DataEpochCallback(trainer))  # before RealTauCallback: a data epoch's evaluation is known
    if args.real_tau_steps > 0:
        trainer.add_callback(RealTauCallback(trainer))
    trainer.add_callback(TrainClockCallback(trainer.train_clock))
    trainer.add_callback(LabelAgreementCallback())
    trainer.add_callback(LoaderPaceCallback())
    if args.max_train_minutes is not None:
        trainer.add_callback(TimeBudgetCallback(args.max_train_minutes))
    trainer.add_callback(StopSignalCallback(trainer.stop_signals))
    add_early_stopping(trainer, args)


def use_concise_progress_bar(trainer) -> None:
    """Replace the Trainer's `ProgressCallback` by `DFlashProgressCallback` (loss / tau_est as the bar's postfix)."""
    for cb in list(trainer.callback_handler.callbacks):
        if type(cb) is ProgressCallback:
            trainer.callback_handler.remove_callback(cb)
            trainer.add_callback(DFlashProgressCallback(cb.max_str_len))


__all__ = [
    "AgreedFlag",
    "DataEpochCallback",
    "DFlashProgressCallback",
    "LabelAgreementCallback",
    "LoaderPaceCallback",
    "RealTauCallback",
    "StopSignalCallback",
    "TimeBudgetCallback",
    "TrainClockCallback",
    "add_dflash_callbacks",
    "use_concise_progress_bar",
]
