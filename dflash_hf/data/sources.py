"""Data sources -> lazy lhotse CutSets.

- NeMo ASR manifests (JSON lines, plain or gzipped): ``audio_filepath`` (absolute or relative to the manifest),
  ``duration``, ``text``, optional ``offset`` and ``lang``; every other key is kept in ``cut.custom`` (e.g.
  ``context``).
- lhotse CutSet files (``.jsonl`` / ``.jsonl.gz``) of MonoCuts, read lazily; audio sources of type ``command``
  or ``url`` are refused unless allowed.
Audio headers and samples are read without running programs unless the source allows it (``audio_files.py``).
- Hugging Face ``datasets``: an audio column holding paths, ``{"path", "bytes"}`` dicts (``Audio(decode=False)``)
  or ``{"array", "sampling_rate"}`` dicts, plus a text column; ``audio_column=None`` for text-only data.

Several sources are mixed lazily with weights (``CutSet.mux``). Each cut has one supervision whose text is
the assistant response; cut ids are ``<manifest stem>-<line index>`` unless the line has an ``id`` key.
Each cut records its source row in ``cut.custom["dflash_origin"]`` (error messages and skip counts use it).
JSON-lines rows are scanned by ``json_rows.py``; the lhotse cuts reader is ``lhotse_cuts.py``.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
from lhotse import CutSet, MonoCut, Recording, SupervisionSegment

from dflash_hf.data.audio_files import (
    REFUSAL_FIX,
    ExternalDecoderRefused,
    audio_file_stat,
    audio_path_problem,
    mark_programs,
    recording_from_bytes,
    recording_from_file,
)
from dflash_hf.data.bad_samples import ORIGIN_KEY, BadSampleError, BadSamples
from dflash_hf.data.generated import row_problem
from dflash_hf.data.json_rows import Span, describe_value, detect_kind, json_rows, manifest_stem, seconds_problem
from dflash_hf.data.lhotse_cuts import LhotseCuts
from dflash_hf.data.row_scan import check_rows
from dflash_hf.settings import DataSettings

NEMO_KEYS = ("audio_filepath", "duration", "text", "offset", "lang")
MAX_REMEMBERED_HEADERS = 1 << 17  # audio headers a manifest keeps across epochs (about 1 KB each: 130 MB at most)


@dataclass
class DataSource:
    """One input. Give ``path`` (NeMo manifest or lhotse cuts file, plain or gzipped; ``kind`` detected from the
    first line when None) or ``hf_dataset`` (a ``datasets.Dataset`` or a ``save_to_disk`` directory).
    ``weight`` is the relative sampling weight when several sources are mixed. lhotse cuts whose audio comes
    from a shell command or a URL are refused unless ``allow_command_audio_sources`` /
    ``allow_url_audio_sources`` is True; the first also lets decoder programs (ffmpeg through audioread) read audio
    files libsndfile cannot (``audio_files.py``). A row whose text has more than ``max_chars_per_second`` characters
    per second of its audio is a bad sample (``json_rows.text_rate_problem``; None or 0: not checked)."""

    path: str | None = None
    weight: float = 1.0
    kind: str | None = None
    hf_dataset: Any = None
    audio_column: str | None = "audio"
    text_column: str = "text"
    context_column: str | None = "context"
    id_column: str | None = None
    allow_command_audio_sources: bool = DataSettings.allow_command_audio_sources
    allow_url_audio_sources: bool = DataSettings.allow_url_audio_sources
    max_chars_per_second: float | None = DataSettings.max_chars_per_second


def nemo_cut_id(record: dict, default_id: str) -> str:
    """A manifest line's cut id: its `id` when that is a string or an integer, else `default_id`."""
    cut_id = record.get("id")
    return str(cut_id) if isinstance(cut_id, (str, int)) and not isinstance(cut_id, bool) else default_id


def check_nemo_record(
    record: dict, cut_id: str, bad: BadSamples, origin: str | None = None, max_chars_per_second: float | None = None
) -> bool:
    """Keys and value types of one NeMo manifest line (no file access; generated labels' ``label_ids`` /
    ``truncated`` too), and a text implausibly long for the line's duration (``max_chars_per_second``); a problem goes
    to ``bad``."""

    def fail(key: str, problem: str, fix: str) -> bool:
        bad.report(cut_id, key, problem, fix, origin=origin)
        return False

    for key in ("audio_filepath", "text"):
        if key not in record:
            return fail(key, "missing from the manifest line", f"add '{key}' to every line")
    path = record["audio_filepath"]
    if not isinstance(path, str) or not path.strip():
        return fail(
            "audio_filepath",
            f"is {describe_value(path)}, not a file path",
            "write the audio file's path as a non-empty JSON string",
        )
    if not isinstance(record["text"], str):
        return fail("text", f"is {describe_value(record['text'])}, not a string", "write the response as a JSON string")
    for key, positive in (("duration", True), ("offset", False)):
        if record.get(key) is not None:
            problem = seconds_problem(record[key], positive=positive)
            if problem:
                return fail(
                    key,
                    problem,
                    f"write '{key}' as seconds ({'> 0' if positive else '>= 0'}), or leave it "
                    "out" + (" for the rest of the file" if positive else " for 0"),
                )
    if record.get("lang") is not None and not isinstance(record["lang"], str):
        return fail("lang", f"is {describe_value(record['lang'])}, not a string", 'write a language code such as "en"')
    if "id" in record and nemo_cut_id(record, "") == "":
        return fail("id", f"is {describe_value(record['id'])}, not a string or integer", "write a unique string id")
    problem = row_problem(record, record["text"], record.get("duration"), max_chars_per_second)
    return fail(*problem) if problem else True


def nemo_line_to_cut(
    record: dict,
    cut_id: str,
    manifest_dir: Path,
    bad: BadSamples,
    origin: str | None = None,
    *,
    allow_programs: bool = False,
) -> MonoCut | None:
    """One NeMo manifest line -> MonoCut (checks the line, reads only the audio header). None when skipped.
    ``allow_programs``: decoder programs may read the audio (``audio_files.py``)."""
    if not check_nemo_record(record, cut_id, bad, origin):
        return None
    return _nemo_cut(record, cut_id, manifest_dir, bad, origin, allow_programs=allow_programs)


def _nemo_cut(
    record: dict,
    cut_id: str,
    manifest_dir: Path,
    bad: BadSamples,
    origin: str | None,
    recordings: dict | None = None,
    *,
    allow_programs: bool = False,
) -> MonoCut | None:
    """A checked NeMo line -> MonoCut: the audio file must exist and have a header libsndfile reads (or, with
    ``allow_programs``, a decoder program). `recordings`: headers already read, by (path, size, modification time);
    a file changed since is read again."""
    path = Path(record["audio_filepath"]).expanduser()
    if not path.is_absolute():
        path = manifest_dir / path
    info, problem = audio_file_stat(path)
    if problem:
        bad.report(
            cut_id,
            "audio_filepath",
            problem,
            "point it at an audio file (relative paths are resolved against the manifest's directory)",
            origin=origin,
        )
        return None
    if info.st_size == 0:
        bad.report(
            cut_id,
            "audio_filepath",
            f"audio file {str(path)!r} is empty (0 bytes)",
            "replace the file or remove the line",
            origin=origin,
        )
        return None
    key = (str(path), info.st_size, info.st_mtime_ns)
    recording = recordings.get(key) if recordings is not None else None
    if recording is None:
        try:
            recording = recording_from_file(path, str(path), allow_programs)
        except ExternalDecoderRefused as e:
            bad.report(cut_id, "audio_filepath", str(e), REFUSAL_FIX, origin=origin)
            return None
        except Exception as e:  # noqa: BLE001 - any decoder failure means the file is unusable
            bad.report(
                cut_id,
                "audio_filepath",
                f"audio file {str(path)!r} is unreadable ({type(e).__name__}: {e})",
                "re-encode the file as wav or flac",
                origin=origin,
            )
            return None
        if recordings is not None and len(recordings) < MAX_REMEMBERED_HEADERS:
            recordings[key] = recording
    offset = float(record.get("offset") or 0.0)
    duration = record.get("duration")
    duration = recording.duration - offset if duration is None else float(duration)
    extras = {k: v for k, v in record.items() if k not in NEMO_KEYS}
    mark_programs(extras, allow_programs)
    if origin is not None:
        extras[ORIGIN_KEY] = origin
    return make_cut(cut_id, recording, offset, duration, record["text"], record.get("lang"), extras)


def make_cut(cut_id, recording, start, duration, text, language, custom) -> MonoCut:
    """A one-supervision cut: `recording` (None: a text row) from `start` for `duration` seconds, whose supervision
    holds `text` in `language`, with the row's other fields as `custom`."""
    supervision = SupervisionSegment(
        id=cut_id,
        recording_id=recording.id if recording is not None else cut_id,
        start=0.0,
        duration=duration,
        channel=0,
        text=text,
        language=language,
    )
    return MonoCut(
        id=cut_id,
        start=start,
        duration=duration,
        channel=0,
        recording=recording,
        supervisions=[supervision],
        custom=dict(custom) or None,
    )


class NemoManifest:
    """Lazy, re-iterable NeMo manifest reader (plain or gzipped) yielding MonoCuts (bad lines go to ``bad``).
    ``check()`` reads every line once without touching audio, so malformed lines surface before training."""

    def __init__(
        self,
        path: str | Path,
        bad: BadSamples | None = None,
        *,
        allow_programs: bool = False,
        max_chars_per_second: float | None = None,
        span: Span | None = None,
    ):
        self.path = Path(path)
        self.bad = bad if bad is not None else BadSamples(skip=False)
        self.allow_programs = allow_programs
        self.max_chars_per_second = max_chars_per_second
        self.span = span  # only that part of the file (`row_scan`)
        self._recordings: dict = {}  # audio headers read in an earlier epoch (lhotse Recordings)

    def _records(self) -> Iterator[tuple[str, str, dict]]:
        """``(cut id, origin, record)`` of the lines whose keys and types are right."""
        prefix = manifest_stem(self.path)
        for index, origin, record in json_rows(self.path, self.bad, id_prefix=prefix, span=self.span):
            cut_id = nemo_cut_id(record, f"{prefix}-{index:08d}")
            if check_nemo_record(record, cut_id, self.bad, origin, self.max_chars_per_second):
                yield cut_id, origin, record

    def check(self) -> None:
        for _ in self._records():
            pass

    def __iter__(self) -> Iterator[MonoCut]:
        manifest_dir = self.path.parent
        for cut_id, origin, record in self._records():
            cut = _nemo_cut(
                record, cut_id, manifest_dir, self.bad, origin, self._recordings, allow_programs=self.allow_programs
            )
            if cut is not None:
                yield cut


class HFDatasetCuts:
    """Lazy, re-iterable view of a ``datasets.Dataset`` as MonoCuts (audio is not decoded by ``datasets``)."""

    def __init__(
        self,
        dataset,
        *,
        audio_column: str | None = "audio",
        text_column: str = "text",
        context_column: str | None = "context",
        id_column: str | None = None,
        name: str = "hf",
        bad: BadSamples | None = None,
        allow_programs: bool = False,
    ):
        if audio_column is not None and audio_column in dataset.column_names:
            from datasets import Audio

            if isinstance(dataset.features.get(audio_column), Audio):
                dataset = dataset.cast_column(audio_column, Audio(decode=False))
        elif audio_column is not None:
            raise ValueError(
                f"HF dataset has no audio column {audio_column!r} (columns: {dataset.column_names});"
                " set audio_column (None for text-only data)"
            )
        if text_column not in dataset.column_names:
            raise ValueError(f"HF dataset has no text column {text_column!r} (columns: {dataset.column_names})")
        self.dataset = dataset
        self.audio_column, self.text_column = audio_column, text_column
        self.context_column = context_column if context_column in dataset.column_names else None
        self.id_column, self.name = id_column, name
        self.allow_programs = allow_programs
        self.bad = bad if bad is not None else BadSamples(skip=False)

    def __iter__(self) -> Iterator[MonoCut]:
        for index, row in enumerate(self.dataset):
            cut_id = str(row[self.id_column]) if self.id_column else f"{self.name}-{index:08d}"
            origin = f"hf dataset {self.name!r} row {index}"
            custom = {"context": row[self.context_column]} if self.context_column else {}
            custom[ORIGIN_KEY] = origin
            mark_programs(custom, self.allow_programs)
            text = row[self.text_column]
            if self.audio_column is None:
                yield make_cut(cut_id, None, 0.0, 0.0, text, None, custom)
                continue
            recording = self._recording(cut_id, row[self.audio_column], origin)
            if recording is not None:
                yield make_cut(cut_id, recording, 0.0, recording.duration, text, None, custom)

    def _recording(self, cut_id: str, audio, origin: str) -> Recording | None:
        try:
            if isinstance(audio, str):
                audio = {"path": audio}
            if not isinstance(audio, dict):
                raise TypeError(f"expected a path or a dict, got {type(audio).__name__}")
            if audio.get("bytes"):
                return recording_from_bytes(audio["bytes"], cut_id, self.allow_programs)
            if audio.get("array") is not None:
                buffer = io.BytesIO()
                sf.write(
                    buffer,
                    np.asarray(audio["array"], dtype=np.float32),
                    int(audio["sampling_rate"]),
                    format="WAV",
                    subtype="FLOAT",
                )
                return recording_from_bytes(buffer.getvalue(), cut_id)
            if audio.get("path"):
                path = Path(audio["path"])
                problem = audio_path_problem(path)
                if problem:
                    self.bad.report(cut_id, self.audio_column, problem, "point it at an audio file", origin=origin)
                    return None
                return recording_from_file(path, cut_id, self.allow_programs)
            raise ValueError("the dict has none of 'bytes', 'array', 'path'")
        except BadSampleError:  # already reported (strict mode): not an unreadable-audio error
            raise
        except ExternalDecoderRefused as e:
            self.bad.report(cut_id, self.audio_column, str(e), REFUSAL_FIX, origin=origin)
            return None
        except Exception as e:  # noqa: BLE001 - reported with the cut id
            self.bad.report(
                cut_id,
                self.audio_column,
                f"audio is unreadable ({type(e).__name__}: {e})",
                "store a path, encoded bytes, or {'array', 'sampling_rate'}",
                origin=origin,
            )
            return None


def open_source(source: DataSource | str | Path, bad: BadSamples | None = None) -> CutSet:
    """A lazy CutSet for one source. Every row of a manifest or cuts file is first checked once without audio access
    (``row_scan.check_rows``: remembered in this process, in parallel for a large file), so a malformed line is an
    error, or a counted skip, before training starts."""
    if not isinstance(source, DataSource):
        source = DataSource(path=str(source))
    bad = bad if bad is not None else BadSamples(skip=False)
    if source.hf_dataset is not None:
        dataset = source.hf_dataset
        if isinstance(dataset, (str, Path)):
            from datasets import load_from_disk

            dataset = load_from_disk(str(dataset))
        return CutSet(
            HFDatasetCuts(
                dataset,
                audio_column=source.audio_column,
                text_column=source.text_column,
                context_column=source.context_column,
                id_column=source.id_column,
                name=Path(str(source.path or "hf")).stem,
                bad=bad,
                allow_programs=source.allow_command_audio_sources,
            )
        )
    reader = file_reader(source, bad)
    check_rows(source, file_reader, bad)
    return CutSet(reader)


def file_reader(source: DataSource, bad: BadSamples, span: Span | None = None) -> NemoManifest | LhotseCuts:
    """The reader of a manifest or cuts file (``source.kind``, or detected from its first line); ``span``: only
    that part of the file."""
    if source.path is None:
        raise ValueError("DataSource needs path= or hf_dataset=")
    kind = source.kind or detect_kind(source.path)
    if kind == "nemo":
        return NemoManifest(
            source.path,
            bad,
            allow_programs=source.allow_command_audio_sources,
            max_chars_per_second=source.max_chars_per_second,
            span=span,
        )
    if kind == "lhotse":
        return LhotseCuts(
            source.path,
            bad,
            allow_command_audio_sources=source.allow_command_audio_sources,
            allow_url_audio_sources=source.allow_url_audio_sources,
            max_chars_per_second=source.max_chars_per_second,
            span=span,
        )
    raise ValueError(f"DataSource.kind must be 'nemo', 'lhotse' or None, got {kind!r}")


def mix_sources(sources: Sequence[DataSource | str | Path], *, seed: int = 0, bad: BadSamples | None = None) -> CutSet:
    """One lazy CutSet from several sources, interleaved at random in proportion to their weights
    (deterministic under ``seed``); an epoch ends when every source is exhausted."""
    sources = [s if isinstance(s, DataSource) else DataSource(path=str(s)) for s in sources]
    if not sources:
        raise ValueError("no data sources given")
    if any(s.weight <= 0 for s in sources):
        raise ValueError(f"source weights must be > 0, got {[s.weight for s in sources]}")
    cutsets = [open_source(s, bad) for s in sources]
    if len(cutsets) == 1:
        return cutsets[0]
    return CutSet.mux(*cutsets, weights=[s.weight for s in sources], seed=seed)
