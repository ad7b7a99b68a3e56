"""What `DFlashTrainer` logs and reports, kept out of trainer.py: the entries of a training log step (from the
objective's report of the window's all-reduced `MetricSums`), the metrics of one validation set, and the validation
metrics already logged at a step."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

from dflash_hf.objective.losses import MetricSums


@dataclass
class HostTimes:
    """Where a training loop's wall time goes on the host, per optimizer step of a logging window: waiting for the
    loader's micro-batches (`data_wait_ms`: high against `step_ms` means the loader, not the device, sets the pace),
    planning their blocks (`plan_ms`, anchors drawn on the CPU) and the whole step (`step_ms`: wall clock from the
    window's first batch fetch to the log, over its steps; evaluation and checkpoints after a log are left out)."""

    data_s: float = 0.0
    plan_s: float = 0.0
    steps: int = 0
    since: float | None = None  # the window's first fetch (what runs between a log and it is not a step's)
    fetched: float = 0.0  # when the current step's micro-batches arrived
    got: int = 0  # how many came

    def fetch(self, iterator, n: int) -> list:
        """The next `n` items of `iterator` (fewer at its end), timed as waiting for data."""
        start = time.perf_counter()
        if self.since is None:
            self.since = start
        items = list(itertools.islice(iterator, n))
        self.fetched = time.perf_counter()
        self.data_s += self.fetched - start
        self.got = len(items)
        return items

    def planned(self) -> None:
        """The step's micro-batches are planned: the time since `fetch` returned is planning; one step more (none if
        the iterator was exhausted)."""
        self.plan_s += time.perf_counter() - self.fetched
        self.steps += self.got > 0

    def entries(self) -> dict[str, float]:
        """The window's means in ms, then a new window (empty, and the window goes on, if no step ended in it)."""
        if not self.steps:
            return {}
        now = time.perf_counter()
        out = {
            "data_wait_ms": round(1000 * self.data_s / self.steps, 2),
            "plan_ms": round(1000 * self.plan_s / self.steps, 2),
            "step_ms": round(1000 * (now - self.since) / self.steps, 2),
        }
        self.data_s, self.plan_s, self.steps, self.since = 0.0, 0.0, 0, None
        return out


@dataclass
class TrainClock:
    """Wall-clock minutes of training, logged as `train_minutes` in every log of a training run (training windows,
    evaluations, real tau): from the start of the training loop, evaluation, decoding and checkpoint saving included,
    added to the last `train_minutes` the resumed checkpoint's log holds. What a tau-versus-minutes curve is drawn
    over (benchmarks/tau_curve.py); loading the models before the loop is not counted."""

    base: float = 0.0
    start: float | None = None

    def begin(self, log_history: list[dict]) -> None:
        self.base = max((e["train_minutes"] for e in log_history if "train_minutes" in e), default=0.0)
        self.start = time.monotonic()

    def entries(self) -> dict[str, float]:
        """`{"train_minutes": ...}` once the loop has begun, else nothing (a validate-only evaluation)."""
        if self.start is None:
            return {}
        return {"train_minutes": round(self.base + (time.monotonic() - self.start) / 60, 4)}


def train_log_entries(
    metrics: dict[str, float], sums: MetricSums, accumulation: int, world_size: int
) -> dict[str, float]:
    """The entries a training log step gets: `metrics` (the objective's report of `sums`, `loss` first) rounded,
    anchors per optimizer step and skipped steps. `sums` cover every rank of the logging window."""
    # micro-batches / (GA * ranks) = optimizer steps in this logging window
    steps = max(sums.values.get("micro_batches", 1.0) / (accumulation * world_size), 1.0)
    logs = {"loss": round(metrics.pop("loss"), 6)}
    logs.update({k: round(v, 5) for k, v in metrics.items()})
    logs["anchors_per_step"] = sums.values.get("anchors", 0.0) / steps
    # every micro-batch of a skipped step (global denominator 0) on every rank counted one
    logs["skipped_steps"] = sums.values.get("skipped", 0.0) / (accumulation * world_size)
    return logs


def logged_eval_metrics(log_history: list[dict], step: int) -> dict[str, float]:
    """The `eval*` metrics that evaluations logged at `step` (`evaluate` logs each validation set with its
    `*_runtime`); empty when none ran at that step."""
    done: dict[str, float] = {}
    for entry in log_history:
        if entry.get("step") == step and any(k.startswith("eval") and k.endswith("_runtime") for k in entry):
            done.update({k: v for k, v in entry.items() if k.startswith("eval")})
    return done


def eval_set_metrics(metrics: dict[str, float], dataloader, prefix: str, start: float) -> dict[str, float]:
    """`metrics` of one validation set (`prefix`), with the rows its speech loader skipped and the runtime since
    `start`; a non-finite loss is an error."""
    if getattr(dataloader, "bad_samples", None) is not None:  # speech loader: rows skipped in this set
        metrics[f"{prefix}_skipped_samples"] = dataloader.bad_samples.num_skipped
    metrics[f"{prefix}_runtime"] = round(time.time() - start, 4)
    if not math.isfinite(metrics.get(f"{prefix}_loss", 0.0)):
        raise FloatingPointError(f"non-finite {prefix}_loss")
    return metrics


__all__ = ["HostTimes", "TrainClock", "eval_set_metrics", "logged_eval_metrics", "train_log_entries"]
