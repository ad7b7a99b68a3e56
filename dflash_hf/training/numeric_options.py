"""The ranges of `dflash-train`'s numeric options, checked in one place (light: no torch, no transformers).

`TrainingArguments` takes `--max_grad_norm nan` (clipping silently off), a negative `--weight_decay`, a learning rate
of 0 or NaN, Adam betas of 1 and more; the DFlash options had their bounds spread over the argument classes. Each
option here has its range; a value outside it (NaN and infinities included, unless the range allows them) is one
`ValueError` naming the option, its range and the value (`dflash-train`: one line, exit status 2), raised when the
arguments are parsed, before anything loads. Options a run does not have (older transformers) are not checked;
an unset option (None) is not checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """`low` / `high` bounds (`*_open`: the bound itself excluded; None: unbounded), finite unless `infinite_ok`
    (`integer`: a count, whose message needs no "finite"). `whole_from`: values from there up must be whole numbers.
    `why` follows the range in the message (in parentheses), `fix` the value; `phrase` replaces the range text."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    infinite_ok: bool = False
    integer: bool = False
    whole_from: float | None = None
    why: str = ""
    fix: str = ""
    phrase: str = ""

    def text(self) -> str:
        if self.phrase:
            return self.phrase
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{_num(self.low)}, {_num(self.high)}{right}"
        bound = f"{'>' if self.low_open else '>='} {_num(self.low)}" if self.low is not None else ""
        if self.high is not None:
            bound = f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return bound if self.infinite_ok or self.integer else f"{bound} and finite"

    def holds(self, value: float) -> bool:
        if math.isnan(value) or (math.isinf(value) and not self.infinite_ok):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            return False
        return self.whole_from is None or value < self.whole_from or float(value).is_integer()


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _count(low: int, why: str = "", phrase: str = "") -> Range:
    """An integer option (a count): `>= low`, no 'finite' in the message (an int is)."""
    return Range(low=low, integer=True, why=why, phrase=phrase)


UNIT = Range(low=0, high=1, high_open=True)
STEPS = " (a number of steps, or a fraction < 1 of the training steps)"
# TrainingArguments options whose range transformers does not check (it does check gradient_accumulation_steps's
# type, logging_steps > 0 with the steps strategy and warmup_steps >= 0).
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
    "max_steps": _count(-1, " (-1: from num_train_epochs)"),
    "logging_steps": Range(low=0, low_open=True, why=STEPS),
    "save_steps": Range(low=0, low_open=True, why=STEPS),
    "eval_steps": Range(low=0, low_open=True, why=STEPS),
    "save_total_limit": _count(1, " (or unset to keep every checkpoint)"),
    "per_device_train_batch_size": _count(1),
    "per_device_eval_batch_size": _count(1),
    "gradient_accumulation_steps": _count(1),
    "dataloader_num_workers": _count(0, " (0: batches are made in the training process)"),
    "seed": Range(low=0, high=2**32 - 1),
    "data_seed": Range(low=0, high=2**32 - 1),
}
# The DFlash training options (argument_groups.py).
DFLASH_RANGES = {
    "num_draft_layers": _count(1),
    "num_anchors": _count(1),
    "anchor_pad_multiple": _count(1),
    "ce_chunk_size": _count(1),
    "target_argmax_chunk_size": _count(1, phrase="> 0"),
    "label_top_k": _count(1),
    "real_tau_steps": _count(0, " (0: off)"),
    "real_tau_samples": _count(1),
    "real_tau_max_new_tokens": _count(1),
    "anchor_budget": _count(1, " (or unset for no cap)"),
    "early_stopping_patience": _count(1, " (evaluations, or unset)"),
    "skip_oom_batches": _count(0, " (0: a step out of GPU memory stops the run)"),
    "lora_r": _count(0, " (0 = LoRA off)"),
    "gamma": Range(
        low=0,
        low_open=True,
        why=" (slot weights w_k = exp(-(k-1)/gamma))",
        fix="; leave it unset for the recipe default (7/5/4 for block_size 16/10/8)",
    ),
    "dpace_alpha": Range(low=0, high=1, low_open=True),
    "selector_loss_weight": Range(low=0),
    "lora_alpha": Range(low=0, low_open=True),
    "lora_dropout": UNIT,
    "early_stopping_threshold": Range(low=0),
    "max_train_minutes": Range(low=0, low_open=True, phrase="a positive number of minutes (or unset)"),
}
# The data options (argument_groups.DFlashDataArguments); `train_data_weights` is checked item by item.
DATA_RANGES = {
    "max_tokens": _count(1),
    "max_batch_size": _count(1, " (or unset)"),
    "num_buckets": _count(1),
    "train_data_weights": Range(low=0, low_open=True, why=" (one sampling weight per train_data path)"),
    "max_chars_per_second": Range(low=0, why=" (0: off)"),
}


def range_problem(name: str, value, rule: Range) -> str | None:
    """The message for `name=value` outside `rule` (None when it holds, is unset or is not a number)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    for item in values:
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            continue
        if not rule.holds(float(item)):
            shown = list(values) if isinstance(value, (list, tuple)) else item
            return f"{name} must be {rule.text()}{rule.why}, got {shown}{rule.fix}"
    return None


def check_ranges(args, ranges: dict[str, Range]) -> None:
    """Raise `ValueError` for the first option of `ranges` that `args` has and whose value is outside its range."""
    for name, rule in ranges.items():
        problem = range_problem(name, getattr(args, name, None), rule)
        if problem:
            raise ValueError(problem)


__all__ = ["DATA_RANGES", "DFLASH_RANGES", "TRAINER_RANGES", "Range", "check_ranges", "range_problem"]
