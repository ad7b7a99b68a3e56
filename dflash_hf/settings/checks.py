"""How a setting is declared and checked: `setting()` (default, help, choices), the numeric `Range` of an option and
the `Settings` base class, whose `validate` checks ranges and choices (light: no torch, no transformers).

A value outside its range (NaN and infinities included, unless the range allows them) is one `ValueError` naming the
option, its range and the value (`dflash-train`: one line, exit status 2), raised when the settings (or the training
arguments made of them) are built, before anything loads. An unset option (None) is not checked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar


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


def count(low: int, why: str = "", phrase: str = "") -> Range:
    """An integer option (a count): `>= low`, no 'finite' in the message (an int is)."""
    return Range(low=low, integer=True, why=why, phrase=phrase)


UNIT = Range(low=0, high=1, high_open=True)


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


def check_ranges(values, ranges: Mapping[str, Range]) -> None:
    """Raise `ValueError` for the first option of `ranges` that `values` has and whose value is outside its range."""
    for name, rule in ranges.items():
        problem = range_problem(name, getattr(values, name, None), rule)
        if problem:
            raise ValueError(problem)


def check_choice(name: str, value, choices) -> None:
    """`value` (or each item of a list) is one of `choices`, else a `ValueError` naming the option and the choices."""
    items = value if isinstance(value, (list, tuple)) else [value]
    bad = [item for item in items if item is not None and item not in choices]
    if bad:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")


def setting(default: Any = MISSING, help: str = "", *, choices: tuple | None = None, factory=MISSING) -> Field:
    """A documented settings field. `help` is the option's `--help` text, `choices` its allowed values (checked by the
    parser and by `Settings.validate`); `factory` makes a mutable default. The metadata is what `HfArgumentParser`
    hands to argparse, so it holds nothing else."""
    metadata = {"help": help} | ({"choices": choices} if choices is not None else {})
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def check_paths_exist(values, names) -> None:
    """Refuse (before any loading) the first path option of `names` on `values` that names nothing on disk."""
    for name in names:
        if not Path(getattr(values, name)).exists():
            raise FileNotFoundError(f"--{name} {getattr(values, name)!r} does not exist")


S = TypeVar("S", bound="Settings")


class Settings:
    """Base of the settings dataclasses: validated once when built (`__post_init__` -> `validate`), numeric ranges in
    `RANGES` (field name -> `Range`). `validate` is a classmethod taking any object with the fields (a settings
    instance, or the training arguments that combine several settings classes), so each class checks its own fields
    wherever they live; subclasses extend it with the checks that involve several fields."""

    RANGES: ClassVar[dict[str, Range]] = {}

    def __post_init__(self) -> None:
        type(self).validate(self)

    @classmethod
    def validate(cls, values) -> None:
        check_ranges(values, cls.RANGES)
        for f in fields(cls):
            if f.metadata.get("choices") is not None:
                check_choice(f.name, getattr(values, f.name), f.metadata["choices"])

    @classmethod
    def of(cls: type[S], values, **changes) -> S:
        """These settings taken from `values` (any object with the fields, e.g. the training arguments; a field it
        lacks keeps its default), with `changes` applied."""
        found = {f.name: getattr(values, f.name) for f in fields(cls) if f.init and hasattr(values, f.name)}
        return cls(**(found | changes))


__all__ = [
    "UNIT",
    "Range",
    "Settings",
    "check_choice",
    "check_paths_exist",
    "check_ranges",
    "count",
    "range_problem",
    "setting",
]
