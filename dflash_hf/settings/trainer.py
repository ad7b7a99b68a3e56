"""The inherited `TrainingArguments` options: the ones whose DFlash default or meaning differs (`TRAINER_OVERRIDES`)
and the ranges transformers does not check (`TRAINER_RANGES`). Light: nothing imported from transformers."""

from __future__ import annotations

from dflash_hf.settings.checks import UNIT, Range, count

# TrainingArguments fields whose DFlash default or meaning differs: (default, help).
TRAINER_OVERRIDES = {
    "learning_rate": (6e-4, "AdamW learning rate (DFlash default 6e-4)."),
    "lr_scheduler_type": ("constant", "LR schedule (default constant)."),
    "weight_decay": (0.0, "AdamW weight decay."),
    "remove_unused_columns": (False, "Kept False: DFlash batches carry audio and loss-mask keys."),
    "save_safetensors": (True, "Checkpoints in safetensors."),
    "logging_nan_inf_filter": (
        False,
        "Trainer's filter that hides nan/inf losses from the logged average. Off by default: it reads every "
        "micro-batch's loss on the host, which stalls the GPU between steps; a non-finite loss is then logged as "
        "it is (the step is taken either way).",
    ),
    "push_to_hub": (
        False,
        "Publish the exported draft (serving files and a generated model card) to --hub_model_id at the end of "
        "training. Checkpoints are not uploaded.",
    ),
    "hub_model_id": (None, "Hub repo (org/name) that --push_to_hub publishes the exported draft to."),
    "ddp_find_unused_parameters": (
        False,
        "DDP: search for parameters without gradient every step. False: every trainable draft parameter takes part "
        "in every step's loss (also on a rank without valid anchors).",
    ),
    "resume_from_checkpoint": (
        None,
        "Resume training from this complete checkpoint-N directory, or true: from the last complete checkpoint in "
        "output_dir (incomplete ones, from interrupted saves, are skipped), or auto: as true when there is one, else "
        "start the run (a job script that is requeued after preemption).",
    ),
}

STEPS = " (a number of steps, or a fraction < 1 of the training steps)"
# TrainingArguments options whose range transformers does not check (it does check gradient_accumulation_steps's
# type, logging_steps > 0 with the steps strategy and warmup_steps >= 0). Options a transformers version lacks are
# not checked.
TRAINER_RANGES = {
    "learning_rate": Range(low=0, low_open=True, why=" (the AdamW step size, e.g. 6e-4)"),
    "weight_decay": Range(low=0, why=" (0: no weight decay)"),
    "max_grad_norm": Range(low=0, why=" (0: no clipping)"),
    "adam_beta1": UNIT,
    "adam_beta2": UNIT,
    "adam_epsilon": Range(low=0, low_open=True, why=" (e.g. 1e-8)"),
    "warmup_steps": Range(low=0, whole_from=1, phrase=">= 0: a whole number of steps, or a fraction < 1 of them"),
    "warmup_ratio": Range(low=0, high=1),  # transformers versions that still have it
    "num_train_epochs": Range(low=0),
    "max_steps": count(-1, " (-1: from num_train_epochs)"),
    "logging_steps": Range(low=0, low_open=True, why=STEPS),
    "save_steps": Range(low=0, low_open=True, why=STEPS),
    "eval_steps": Range(low=0, low_open=True, why=STEPS),
    "save_total_limit": count(1, " (or unset to keep every checkpoint)"),
    "per_device_train_batch_size": count(1),
    "per_device_eval_batch_size": count(1),
    "gradient_accumulation_steps": count(1),
    "dataloader_num_workers": count(0, " (0: batches are made in the training process)"),
    "seed": Range(low=0, high=2**32 - 1),
    "data_seed": Range(low=0, high=2**32 - 1),
}

__all__ = ["TRAINER_OVERRIDES", "TRAINER_RANGES"]
