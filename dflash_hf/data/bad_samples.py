"""Bad-data policy: a clear error naming the sample (cut id and source row), the field and the fix, or
(``skip_bad_samples=True``) a counted skip with a warning naming it. Never a silent drop.

Skips are counted by source row (file and line, or dataset row): the same row met again in a later epoch or
by the up-front scan counts once, two bad rows that share a cut id count twice."""

from __future__ import annotations

import logging

logger = logging.getLogger("dflash_hf.data")

ORIGIN_KEY = "dflash_origin"
"""``cut.custom`` key holding the cut's source row (``"<path> line <N>"``, ``"hf dataset <name> row <N>"``)."""

SKIP_HINT = "or pass --skip_bad_samples true to skip and count such rows"


class BadSampleError(ValueError):
    """A sample that cannot be used; the message names the cut id, the source row, the field and the fix."""


def origin_of(cut) -> str | None:
    """The source row a reader recorded on ``cut`` (None for cuts built elsewhere)."""
    return (cut.custom or {}).get(ORIGIN_KEY)


def sample_label(cut_id: str | None, origin: str | None) -> str:
    """``'ID' (PATH line N)``: the sample as messages and skip counts name it (the parts that are known)."""
    parts = [repr(str(cut_id)) if cut_id is not None else None, f"({origin})" if origin else None]
    return " ".join(part for part in parts if part) or "<unknown>"


def bad_sample_message(cut_id: str | None, field: str, problem: str, fix: str, origin: str | None = None) -> str:
    """``bad sample 'ID' (PATH line N): field 'F': PROBLEM. Fix: FIX``."""
    return f"bad sample {sample_label(cut_id, origin)}: field {field!r}: {problem}. Fix: {fix}"


class BadSamples:
    """Counts skipped samples (one per source row, see the module docstring) and raises when skipping is off."""

    def __init__(self, skip: bool = False):
        self.skip = skip
        self.skipped: dict[str, str] = {}  # sample label -> message

    def report(self, cut_id: str | None, field: str, problem: str, fix: str, *, origin: str | None = None) -> None:
        """Raise :class:`BadSampleError`, or record a skip and log a warning when skipping is on. The counting
        key is :func:`sample_label`: one per source row (``origin``), or per cut id for cuts without one."""
        message = bad_sample_message(cut_id, field, problem, fix, origin)
        if not self.skip:
            raise BadSampleError(f"{message} ({SKIP_HINT})")
        key = sample_label(cut_id, origin)
        if key not in self.skipped:
            self.skipped[key] = message
            logger.warning("skipping %s (%d skipped so far)", message, len(self.skipped))

    def add_skipped(self, skipped: dict[str, str]) -> None:
        """Count skips made elsewhere (a collator in a worker process): ``{sample label: message}``."""
        for key, message in skipped.items():
            if key not in self.skipped:
                self.skipped[key] = message
                logger.warning("skipping %s (%d skipped so far)", message, len(self.skipped))

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def summary(self) -> str:
        """One line with the count and the skipped rows (log it at the end of training)."""
        if not self.skipped:
            return "data: no samples skipped"
        return f"data: skipped {self.num_skipped} bad samples: {'; '.join(sorted(self.skipped))}"
