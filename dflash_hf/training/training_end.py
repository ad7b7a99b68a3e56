"""What follows training's last step (docs/RELIABILITY.md, "Environment faults"): its checkpoint, the resume from it,
and the final evaluation's metrics, for `DFlashTrainer`.

- `save_last_step`: at the end of the training loop, before `load_best_model_at_end` loads another draft and before
  the final evaluation and the export, the last step is saved as a periodic checkpoint is, unless it was just saved
  or `save_strategy` is no. transformers saves it itself only under the `steps` and `epoch` strategies; under `best`,
  and where early stopping ends a run between two saves, a fault in the final evaluation or the export would lose
  every step since the last checkpoint.
- `training_ended`: a checkpoint at which training ended (`max_steps` reached, or early stopping's patience used up).
  Resumed from one, transformers' loop trains one more step (it checks for the end after a step) unless that step
  ended one of its epochs; `DFlashTrainer` runs no epoch then, so the resume goes to the final evaluation and the
  export and ends as the uninterrupted run.
"""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import TrainerState
from transformers.trainer import TRAINER_STATE_NAME

from dflash_hf.training.best_model import early_stopping_counter
from dflash_hf.training.checkpoints import checkpoint_dir
from dflash_hf.training.reporting import logged_eval_metrics

logger = logging.getLogger("dflash_hf")


def training_ended(state, max_steps: int, patience: int | None) -> bool:
    """Whether training ends at the step of `state` (a `TrainerState`, as its last checkpoint saved it): `max_steps`
    reached or early stopping's `patience` used up. A run stopped by `max_train_minutes` or a stop signal has not
    ended: its resume trains on."""
    if 0 < max_steps <= state.global_step:
        return True
    counter = early_stopping_counter(state) if patience is not None else None
    return counter is not None and counter >= patience


def resume_trains_no_step(checkpoint: str | Path, max_steps: int, patience: int | None) -> bool:
    """Whether a resume from `checkpoint` trains no step: its `trainer_state.json`, read as the resume reads it, is
    one at which training ended (`training_ended`)."""
    try:
        state = TrainerState.load_from_json(str(Path(checkpoint) / TRAINER_STATE_NAME))
    except (OSError, ValueError):
        return False
    return training_ended(state, max_steps, patience)


def resumed_ended(trainer, max_steps: int, checkpoint: str | None) -> bool:
    """Whether `checkpoint`, whose state `trainer` has just loaded, is one at which training ended (then the loop runs
    no epoch: logged)."""
    state = trainer.state
    if checkpoint is None or not training_ended(state, max_steps, trainer.args.early_stopping_patience):
        return False
    logger.warning(
        "resume: training ended at %s (step %d, max_steps %d): no step is trained; the final evaluation and the export "
        "follow",
        checkpoint,
        state.global_step,
        max_steps,
    )
    return True


def save_last_step(trainer, trial=None) -> None:
    """The checkpoint of the last step (`DFlashTrainer._save_checkpoint`: complete-only, rotated by
    `save_total_limit`), unless `save_strategy` is no, no step was taken, or this step's checkpoint was saved or
    resumed from by this process."""
    args, step = trainer.args, trainer.state.global_step
    if args.save_strategy == "no" or step == 0:
        return
    folder = checkpoint_dir(trainer._get_output_dir(trial=trial), step)
    last = trainer.finite_guard.last_checkpoint  # the last checkpoint saved or resumed from
    if last is not None and Path(last).resolve() == folder.resolve():
        return
    trainer._save_checkpoint(trainer.model, trial)
    trainer.control = trainer.callback_handler.on_save(args, trainer.state, trainer.control)


def untrained_summary(trainer, logs: dict) -> None:
    """The end-of-training log (and metrics) of a resume that trained no step: no `train_loss` (transformers reports
    0.0)."""
    if trainer.trains_no_step and "train_runtime" in logs:
        logs.pop("train_loss", None)


def final_eval_metrics(trainer) -> dict[str, float]:
    """Validation metrics of the trained draft: those of the evaluation the Trainer already ran at the last step (when
    `eval_steps` divides `max_steps`), else a new evaluation. A best checkpoint loaded at the end
    (`load_best_model_at_end`) is another draft, so it is evaluated anew."""
    step = trainer.state.global_step
    best_loaded = trainer.args.load_best_model_at_end and trainer.state.best_global_step not in (None, step)
    done = logged_eval_metrics(trainer.state.log_history, step)
    with trainer.step_faults.handled():  # a fault in this evaluation ends as one in training does
        return done if done and not best_loaded else trainer.evaluate()


__all__ = [
    "final_eval_metrics",
    "resume_trains_no_step",
    "resumed_ended",
    "save_last_step",
    "training_ended",
    "untrained_summary",
]
