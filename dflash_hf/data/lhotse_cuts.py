"""The lhotse cuts reader: a lhotse CutSet file (``.jsonl`` / ``.jsonl.gz``) of MonoCuts, read lazily, every row
checked; audio sources that would run a command or download are refused unless allowed (``GATED_SOURCE_TYPES``), and
each cut records whether decoder programs may read its files (``audio_files.mark_programs``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from lhotse import MonoCut

from dflash_hf.data.audio_files import OPT_IN_FLAG, mark_programs
from dflash_hf.data.bad_samples import ORIGIN_KEY, BadSampleError, BadSamples, bad_sample_message
from dflash_hf.data.generated import row_problem
from dflash_hf.data.json_rows import Span, describe_value, json_rows, seconds_problem
from dflash_hf.settings import DataSettings

GATED_SOURCE_TYPES = {
    "command": ("allow_command_audio_sources", "lhotse would run this shell command to read the audio"),
    "url": ("allow_url_audio_sources", "lhotse would download the audio from this address"),
}
"""lhotse audio source types refused unless the ``DataSource`` field (CLI flag) of the same name allows them."""


class LhotseCuts:
    """Lazy, re-iterable reader of a lhotse cuts file (``.jsonl`` / ``.jsonl.gz``) yielding MonoCuts. Lines that
    are not cuts go to ``bad``; audio sources of a gated type (``GATED_SOURCE_TYPES``) raise unless allowed,
    whatever the skip policy. ``check()`` reads every line once (no audio access) before training."""

    def __init__(
        self,
        path: str | Path,
        bad: BadSamples | None = None,
        *,
        allow_command_audio_sources: bool = DataSettings.allow_command_audio_sources,
        allow_url_audio_sources: bool = DataSettings.allow_url_audio_sources,
        max_chars_per_second: float | None = None,
        span: Span | None = None,
    ):
        self.path = Path(path)
        self.max_chars_per_second = max_chars_per_second
        self.span = span  # only that part of the file (`row_scan`)
        self.bad = bad if bad is not None else BadSamples(skip=False)
        self.allowed = {
            "allow_command_audio_sources": allow_command_audio_sources,
            "allow_url_audio_sources": allow_url_audio_sources,
        }

    def _cut(self, record: dict, origin: str) -> MonoCut | None:
        cut_id = record.get("id") if isinstance(record.get("id"), str) else None
        report = self.bad.report
        if record.get("type") != "MonoCut":
            report(
                cut_id,
                "type",
                f'is {describe_value(record.get("type"))}; only "MonoCut" cuts are supported',
                "store each utterance as a mono cut (MixedCut / MultiCut are not supported)",
                origin=origin,
            )
            return None
        try:
            cut = MonoCut.from_dict(record)
        except Exception as e:  # noqa: BLE001 - any malformed cut is reported with its row
            report(
                cut_id,
                "<cut>",
                f"is not a valid lhotse MonoCut ({type(e).__name__}: {e})",
                "write the file with lhotse (CutSet.to_file)",
                origin=origin,
            )
            return None
        # a text-only cut (no recording) has no audio to time: its duration may be 0
        timed = cut.recording is not None
        for key, value, positive in (("start", cut.start, False), ("duration", cut.duration, timed)):
            problem = seconds_problem(value, positive=positive)
            if problem:
                report(
                    cut.id, key, problem, f"write '{key}' as seconds ({'> 0' if positive else '>= 0'})", origin=origin
                )
                return None
        self._check_sources(cut, origin)  # a refusal (security) comes before any skip below
        text = cut.supervisions[0].text if timed and cut.supervisions else None
        problem = row_problem(cut.custom or {}, text, cut.duration, self.max_chars_per_second)
        if problem:
            report(cut.id, *problem, origin=origin)
            return None
        cut.custom = mark_programs({**(cut.custom or {}), ORIGIN_KEY: origin}, self.allowed[OPT_IN_FLAG])
        return cut

    def _check_sources(self, cut: MonoCut, origin: str) -> None:
        """Refuse audio sources of a gated type unless their flag allows them (never skipped: a security check)."""
        for i, source in enumerate(cut.recording.sources if cut.recording is not None else []):
            flag, what = GATED_SOURCE_TYPES.get(source.type, (None, None))
            if flag is not None and not self.allowed[flag]:
                raise BadSampleError(
                    bad_sample_message(
                        cut.id,
                        f"recording.sources[{i}].type",
                        f"is {source.type!r}: {what} ({str(source.source)[:80]!r}); refused by default",
                        f"pass --{flag} true (DataSource({flag}=True)) only if you trust this file, or store the audio "
                        "as local files",
                        origin,
                    )
                )

    def _cuts(self) -> Iterator[MonoCut]:
        for _, origin, record in json_rows(self.path, self.bad, span=self.span):
            cut = self._cut(record, origin)
            if cut is not None:
                yield cut

    def check(self) -> None:
        for _ in self._cuts():
            pass

    def __iter__(self) -> Iterator[MonoCut]:
        return self._cuts()
