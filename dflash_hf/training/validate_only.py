"""Validate-only: `DFlashTrainer.evaluate` of a trained draft on named validation sets, no training; prints a table
and writes `<output_dir>/validation_metrics.json` (the `--validate_only true` path, docs/EVALUATION.md)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from dflash_hf.targets.frozen import TargetModel, load_target
from dflash_hf.training.trainer import DFlashTrainer

VALIDATION_METRICS_FILE = "validation_metrics.json"


def validate(
    args,
    eval_datasets: Mapping[str, object],
    *,
    target: TargetModel | None = None,
    data_collator=None,
    draft=None,
    **trainer_kwargs,
) -> dict[str, float]:
    """Evaluate a draft on each named validation set with the training label source and anchors seeded by
    batch index, so the metrics equal those of an evaluation inside a training run on the same draft and data.

    `args` is a `DFlashTrainingArguments`; the draft is `draft` or else the export at
    `args.init_from_pretrained`; the target is `target` (HF model or `FrozenTarget`) or else loaded from
    `args.target_name_or_path`; `trainer_kwargs` (e.g. `processor`, `data_args`) go to `DFlashTrainer`.
    Returns `eval_{name}_{tau,loss,tau_est,accuracy,acc_slot{k},runtime}` (`tau` with `args.eval_real_tau`)."""
    check_validation(args, eval_datasets, draft)
    args.check_files()  # before the target loads
    if target is None:
        if not args.target_name_or_path:
            raise ValueError("validate needs the frozen target: set target_name_or_path to its directory")
        target = load_target(args.target_name_or_path, args.precision, args.target_strict_load)
    trainer = DFlashTrainer(
        model=draft,
        args=args,
        target=target,
        eval_dataset=dict(eval_datasets),
        data_collator=data_collator,
        **trainer_kwargs,
    )
    return evaluate_and_report(trainer, list(eval_datasets))


def check_validation(args, eval_datasets: Mapping[str, object] | None, draft=None) -> None:
    """A validation needs validation sets and a trained draft (`draft`, else the export `args.init_from_pretrained`)."""
    if not eval_datasets:
        raise ValueError("validate needs at least one validation set: pass eval_datasets={name: dataset}")
    if draft is None and not args.init_from_pretrained:
        raise ValueError(
            "validate_only evaluates a trained draft: set init_from_pretrained to a draft export directory"
        )


def evaluate_and_report(trainer: DFlashTrainer, names: list[str]) -> dict[str, float]:
    """`trainer.evaluate()` of its validation sets `names`; the main process writes
    `<output_dir>/validation_metrics.json` and prints `metrics_table`."""
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        out = Path(trainer.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / VALIDATION_METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        print(metrics_table(metrics, names))
    return metrics


def metrics_table(metrics: Mapping[str, float], names: list[str], prefix: str = "eval") -> str:
    """One line per validation set: the real tau (`eval_real_tau`; `-` without it), loss, tau_est, accuracy and the
    per-slot accuracies."""
    lines = [f"{'set':<16} {'tau':>6} {'loss':>9} {'tau_est':>8} {'accuracy':>8}  acc_slot1..k"]
    for name in names:
        p = f"{prefix}_{name}_"
        slots, k = [], 1
        while f"{p}acc_slot{k}" in metrics:
            slots.append(f"{metrics[f'{p}acc_slot{k}']:.3f}")
            k += 1
        loss, tau_est, acc = (metrics.get(p + k, float("nan")) for k in ("loss", "tau_est", "accuracy"))
        tau = f"{metrics[p + 'tau']:.3f}" if p + "tau" in metrics else "-"
        lines.append(f"{name:<16} {tau:>6} {loss:>9.4f} {tau_est:>8.3f} {acc:>8.4f}  {' '.join(slots)}")
    return "\n".join(lines)


__all__ = ["VALIDATION_METRICS_FILE", "check_validation", "evaluate_and_report", "metrics_table", "validate"]
