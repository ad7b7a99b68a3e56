"""The best draft by a validation metric: `--metric_for_best_model`, `--load_best_model_at_end` and early stopping
(`--early_stopping_patience`), checked against the metrics `DFlashTrainer.evaluate` reports (docs/EVALUATION.md)."""

from __future__ import annotations

from transformers import EarlyStoppingCallback

# Per validation set, `evaluate` reports eval_<set>_<metric> (eval_<metric> for one unnamed set). These are the ones
# that say how good the draft is; DFlash2 drafts add their selector's. The per-slot acc_slot1..acc_slot<B-1> also are.
# greedy_tau_est scores the draft against the target's own greedy next token (what a greedy decode accepts), whatever
# the label source; tau_est against the training labels (the data's tokens with --label_source ground_truth);
# greedy_walk_tau_est averages the greedy acceptance over the cycles of a decode, as real tau does (not over positions).
# tau is the real acceptance length of speculative decoding of the set's first prompts (--eval_real_tau).
DRAFT_METRICS = ("tau_est", "greedy_tau_est", "greedy_walk_tau_est", "loss", "accuracy")
DFLASH2_METRICS = (
    "selector_tau_est",
    "selector_greedy_tau_est",
    "selector_greedy_walk_tau_est",
    "selector_loss",
    "selector_accuracy",
    "base_loss",
    "candidate_recall",
)


def eval_prefixes(eval_dataset) -> list[str]:
    """The metric prefixes of `eval_dataset` as `evaluate` names them: `eval_<name>_` per named set, `eval_` for one
    dataset, none without validation data."""
    if eval_dataset is None:
        return []
    if isinstance(eval_dataset, dict):
        return [f"eval_{name}_" for name in eval_dataset]
    return ["eval_"]


def selectable_metrics(variant: str, block_size: int, real_tau: bool = False) -> list[str]:
    """The metrics an evaluation reports per set for this draft (`real_tau`: with `--eval_real_tau`, `tau` first)."""
    slots = [f"acc_slot{k}" for k in range(1, block_size)]
    return [*(["tau"] if real_tau else []), *DRAFT_METRICS, *(DFLASH2_METRICS if variant == "dflash2" else ()), *slots]


def _value(strategy) -> str:
    """A strategy setting as its string (TrainingArguments turns them into enums)."""
    return str(getattr(strategy, "value", strategy))


def check_best_model_args(args, prefixes: list[str], variant: str | None = None, block_size: int | None = None) -> None:
    """Refuse, before any step, a best-model or early-stopping setting whose metric no evaluation reports.

    `args`: the training arguments; `prefixes`: `eval_prefixes` of the validation data; `variant` / `block_size`:
    the draft's (default: `args`'s, as the CLI builds the draft from them)."""
    wants = ["load_best_model_at_end"] if args.load_best_model_at_end else []
    if _value(args.save_strategy) == "best":
        wants.append("save_strategy best")
    if args.early_stopping_patience is not None:
        wants.append("early_stopping_patience")
    if args.metric_for_best_model is not None and not wants:  # transformers tracks the best metric all the same
        wants.append("metric_for_best_model")
    if not wants:
        return
    asked = " and ".join(f"--{w}" for w in wants)
    if not prefixes:
        raise ValueError(f"{asked} need validation data to measure the draft on: give --eval_data NAME=PATH")
    if _value(args.eval_strategy) == "no":
        raise ValueError(f"{asked} need evaluations during training: set --eval_strategy steps --eval_steps N")
    if args.load_best_model_at_end and _value(args.save_strategy) == "steps" and args.save_steps != args.eval_steps:
        raise ValueError(
            f"--load_best_model_at_end true saves only every save_steps={args.save_steps} steps, so the best "
            f"evaluation (every eval_steps={args.eval_steps}) may have no checkpoint to load: set --save_steps "
            f"{args.eval_steps} or --save_strategy best"
        )
    metrics = selectable_metrics(variant or args.variant, block_size or args.block_size, args.eval_real_tau)
    choices = [f"{p[len('eval_') :]}{m}" for p in prefixes for m in metrics]
    example = choices[0] if prefixes == ["eval_"] else f"{prefixes[0][len('eval_') :]}{metrics[0]}"
    metric = args.metric_for_best_model
    full = metric if metric is None or metric.startswith("eval_") else f"eval_{metric}"
    if full is None or full not in {f"eval_{c}" for c in choices}:
        raise ValueError(
            f"{asked}: --metric_for_best_model must name a metric the validation reports, got {metric!r}"
            f"{' (transformers default)' if metric == 'loss' else ''}: e.g. --metric_for_best_model {example} "
            f"(higher is better; loss names: lower is better). One of: {', '.join(choices)}"
        )


class ResumableEarlyStopping(EarlyStoppingCallback):
    """transformers' `EarlyStoppingCallback` whose count of evaluations without improvement resumes from the
    checkpoint (transformers restores callback states only with `restore_callback_states_from_checkpoint`), so a
    resumed run stops at the step the uninterrupted one would. Resumed from the checkpoint at which it stopped, a
    run trains no step (`training_end.training_ended`)."""

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        counter = early_stopping_counter(state) if state.global_step > 0 else None
        if counter is not None:  # the checkpoint's trainer_state.json
            self.early_stopping_patience_counter = counter
            if self.early_stopping_patience_counter >= self.early_stopping_patience:
                control.should_training_stop = True

    def on_evaluate(self, args, state, control, metrics, **kwargs):
        """`DFlashTrainer.evaluate` reports each validation set on its own; only the metric's set counts (its name
        was checked before training)."""
        name = args.metric_for_best_model
        if (name if name.startswith("eval_") else f"eval_{name}") in metrics:
            super().on_evaluate(args, state, control, metrics, **kwargs)


def early_stopping_counter(state) -> int | None:
    """The evaluations without improvement that the early stopping of `state` (a checkpoint's `TrainerState`) had
    counted when it was saved; None without early stopping."""
    saved = state.stateful_callbacks.get(ResumableEarlyStopping.__name__)
    return saved["attributes"]["early_stopping_patience_counter"] if isinstance(saved, dict) else None


def add_early_stopping(trainer, args) -> None:
    """Check the best-model settings against the trainer's validation sets and, with `early_stopping_patience`,
    add the early-stopping callback."""
    check_best_model_args(args, eval_prefixes(trainer.eval_dataset), trainer.draft_config.variant, trainer.block_size)
    if args.early_stopping_patience is not None:
        trainer.add_callback(ResumableEarlyStopping(args.early_stopping_patience, args.early_stopping_threshold))


__all__ = [
    "ResumableEarlyStopping",
    "add_early_stopping",
    "check_best_model_args",
    "early_stopping_counter",
    "eval_prefixes",
    "selectable_metrics",
]
