"""Bad-data policy: a clear error naming the cut id, the field and the fix, or (``skip_bad_samples=True``)
a counted skip with a warning naming the id. Never a silent drop."""

from __future__ import annotations

import logging

logger = logging.getLogger("dflash_hf.data")


class BadSampleError(ValueError):
    """A sample that cannot be used; the message names the cut id, the field and the fix."""


class BadSamples:
    """Counts skipped samples (unique cut ids) and raises when skipping is off."""

    def __init__(self, skip: bool = False):
        self.skip = skip
        self.skipped: dict[str, str] = {}

    def report(self, cut_id: str, field: str, problem: str, fix: str) -> None:
        """Raise :class:`BadSampleError`, or record a skip and log a warning when skipping is on."""
        message = f"bad sample {cut_id!r}: field {field!r}: {problem}. Fix: {fix}"
        if not self.skip:
            raise BadSampleError(message + " (or pass skip_bad_samples=True to skip such samples)")
        if cut_id not in self.skipped:
            self.skipped[cut_id] = message
            logger.warning("skipping %s (%d skipped so far)", message, len(self.skipped))

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def summary(self) -> str:
        """One line with the count and the skipped ids (log it at the end of training)."""
        if not self.skipped:
            return "data: no samples skipped"
        return f"data: skipped {self.num_skipped} bad samples: {', '.join(sorted(self.skipped))}"
