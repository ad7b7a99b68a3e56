"""Row scanners of JSON-lines data files (plain or gzipped, detected by content): the rows with their origin
(``"<path> line <N>"``), unreadable lines reported to ``BadSamples``, the file's format, and how a bad value is
described in messages. No lhotse here: the readers in ``sources.py`` and ``lhotse_cuts.py`` build cuts from the rows."""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_hf.data.bad_samples import BadSamples

_JSON_TYPES = {
    dict: "object",
    list: "array",
    str: "string",
    bool: "boolean",
    int: "number",
    float: "number",
    type(None): "null",
}


def describe_value(value: Any) -> str:
    """``a JSON string '1.5'``: the JSON type and a short repr of a value read from a manifest."""
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"a JSON {_JSON_TYPES.get(type(value), type(value).__name__)} {shown}"


def seconds_problem(value: Any, *, positive: bool) -> str | None:
    """Why ``value`` is not a usable number of seconds (None if it is)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is {describe_value(value)}, not a number of seconds"
    if math.isnan(value):
        return "is NaN, not a number of seconds"
    if math.isinf(value):
        return f"is {value}, not a finite number of seconds"
    if value < 0 or (positive and value == 0):
        return f"is {value}; it must be {'> 0' if positive else '>= 0'}"
    return None


MIN_RATE_SECONDS = 0.5  # shorter audio counts as this long (a word or two on a very short clip stays plausible)
RATE_FIX = (
    "check the row's duration (and offset) against its audio and its text against what is said, or raise "
    "--max_chars_per_second (0 turns the check off) for responses that are not transcripts"
)


def text_rate_problem(text, duration, max_chars_per_second: float | None) -> str | None:
    """Why `text` is implausibly long for `duration` seconds of audio (None when it is not, when either is not a
    usable value, or when the check is off)."""
    if not max_chars_per_second or not isinstance(text, str) or isinstance(duration, bool):
        return None
    if not isinstance(duration, (int, float)) or not math.isfinite(duration) or duration <= 0:
        return None
    chars = len(text.strip())
    if chars <= max_chars_per_second * max(duration, MIN_RATE_SECONDS):
        return None
    return (
        f"has {chars} characters for {duration:g} s of audio ({chars / duration:.0f} per second, more than "
        f"--max_chars_per_second {max_chars_per_second:g}; speech reaches about 20)"
    )


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _open_binary(path: str | Path):
    """The file's bytes, gunzipped when it is gzip (by content, whatever its suffix)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"data source {str(path)!r} is a directory; give the manifest or cuts file in it")
    try:
        return gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"data source {str(path)!r} does not exist; fix the path") from None


def manifest_stem(path: Path) -> str:
    """``m`` for ``m.json``, ``m.jsonl.gz``: the default cut-id prefix."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return Path(name).stem


Span = tuple[int, int, int]
"""Part of a plain file: ``(start byte, end byte, index of the line at start)``; start and end lie on line starts."""


def json_rows(
    path: str | Path, bad: BadSamples, id_prefix: str | None = None, span: Span | None = None
) -> Iterator[tuple[int, str, dict]]:
    """``(line index, origin, record)`` for every non-blank line of a JSON-lines file (plain or gzipped) that
    holds a JSON object; ``origin`` is ``"<path> line <N>"`` (1-based). Lines that are not UTF-8, not JSON or
    not an object go to ``bad`` as field ``'<line>'`` (named by cut id ``<id_prefix>-<index>`` when given).
    ``span``: only the lines of that part of a plain file (``row_scan`` reads a large file in parts)."""
    start, end, index = span if span is not None else (0, None, 0)
    index -= 1
    where = f"{path} line "
    with _open_binary(path) as f:
        try:
            if start:
                f.seek(start)
            for raw in f:
                index += 1
                record = _parse_line(raw, index, bad, id_prefix, where)
                if record is not None:
                    yield index, where + str(index + 1), record
                if end is not None:
                    start += len(raw)
                    if start >= end:
                        break
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            raise ValueError(
                f"data source {str(path)!r} cannot be read after line {index + 1} ({type(e).__name__}: "
                f"{e}): the file is truncated or corrupt; re-create it"
            ) from e


def _parse_line(raw: bytes, index: int, bad: BadSamples, id_prefix: str | None, where: str) -> dict | None:
    """The JSON object on one line; None for a blank line or one reported to ``bad`` (`_report_line`)."""
    try:
        line = raw.decode("utf-8-sig" if index == 0 else "utf-8")  # a byte-order mark may open the file
    except UnicodeDecodeError as e:
        problem = f"is not UTF-8 text (byte {e.start}: {raw[e.start : e.start + 1]!r})"
        return _report_line(bad, id_prefix, where, index, problem, "re-save the file as UTF-8")
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return _report_line(bad, id_prefix, where, index, f"not valid JSON ({e})", "fix or remove the line")
    if not isinstance(record, dict):
        problem = f"is {describe_value(record)}, not a JSON object"
        return _report_line(bad, id_prefix, where, index, problem, "write one JSON object per line")
    return record


def _report_line(bad: BadSamples, id_prefix: str | None, where: str, index: int, problem: str, fix: str) -> None:
    """Report line `index` to `bad` as cut ``<id_prefix>-<index>`` of origin ``<where><index + 1>`` (made only for a
    bad line: most are good)."""
    cut_id = f"{id_prefix}-{index:08d}" if id_prefix is not None else None
    bad.report(cut_id, "<line>", problem, fix, origin=f"{where}{index + 1}")


class _IgnoredRows(BadSamples):
    """A sink for rows that another pass reports (format detection looks only for the first good line)."""

    def report(self, *args, **kwargs) -> None:
        pass


def first_valid_record(path: str | Path) -> dict | None:
    """The first JSON object line of a JSON-lines file, or None when it has none (lines that are not JSON objects
    are skipped here, reported by the reader)."""
    return next((r for _, _, r in json_rows(path, _IgnoredRows())), None)


def detect_kind(path: str | Path) -> str:
    """``"nemo"`` if the first JSON object line has ``audio_filepath``, ``"lhotse"`` if it is a serialized cut
    (other lines are skipped here and reported by the reader)."""
    return record_kind(first_valid_record(path), path)


def record_kind(record: dict | None, path: str | Path) -> str:
    """`detect_kind` of the data source `path` whose first JSON object line, `record`, is read already (None: it has
    none)."""
    if record is None:
        raise ValueError(f"data source {str(path)!r} has no JSON object line; expected JSON lines")
    if "audio_filepath" in record:
        return "nemo"
    if "type" in record and ("recording" in record or "supervisions" in record):
        return "lhotse"
    raise ValueError(
        f"data source {str(path)!r}: cannot tell the format from the first line (keys {sorted(record)}); "
        "NeMo manifests need 'audio_filepath', lhotse cuts 'type'; or set DataSource(kind=...)"
    )
