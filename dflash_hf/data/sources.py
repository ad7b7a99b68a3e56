"""Data sources -> lazy lhotse CutSets.

- NeMo ASR manifests (JSON lines): ``audio_filepath`` (absolute or relative to the manifest), ``duration``,
  ``text``, optional ``offset`` and ``lang``; every other key is kept in ``cut.custom`` (e.g. ``context``).
- lhotse CutSet files (``.jsonl`` / ``.jsonl.gz``), read lazily.
- Hugging Face ``datasets``: an audio column holding paths, ``{"path", "bytes"}`` dicts (``Audio(decode=False)``)
  or ``{"array", "sampling_rate"}`` dicts, plus a text column; ``audio_column=None`` for text-only data.

Several sources are mixed lazily with weights (``CutSet.mux``). Each cut has one supervision whose text is
the assistant response; cut ids are ``<manifest stem>-<line index>`` unless the line has an ``id`` key.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
from lhotse import CutSet, MonoCut, Recording, SupervisionSegment

from dflash_hf.data.bad_samples import BadSamples

NEMO_KEYS = ("audio_filepath", "duration", "text", "offset", "lang")


@dataclass
class DataSource:
    """One input. Give ``path`` (NeMo manifest or lhotse cuts file; ``kind`` detected from the first line when
    None) or ``hf_dataset`` (a ``datasets.Dataset`` or a ``save_to_disk`` directory). ``weight`` is the
    relative sampling weight when several sources are mixed."""

    path: str | None = None
    weight: float = 1.0
    kind: str | None = None
    hf_dataset: Any = None
    audio_column: str | None = "audio"
    text_column: str = "text"
    context_column: str | None = "context"
    id_column: str | None = None


def detect_kind(path: str | Path) -> str:
    """``"nemo"`` if the first JSON line has ``audio_filepath``, ``"lhotse"`` if it is a serialized cut
    (lines that are not JSON are skipped here and reported by the reader)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    record = None
    try:
        with opener(path, "rt") as f:
            for line in f:
                try:
                    record = json.loads(line)
                    break
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        raise FileNotFoundError(f"data source {str(path)!r} does not exist; fix the path") from None
    if not isinstance(record, dict):
        raise ValueError(f"data source {str(path)!r} has no JSON object line; expected JSON lines")
    if "audio_filepath" in record:
        return "nemo"
    if "type" in record and ("recording" in record or "supervisions" in record):
        return "lhotse"
    raise ValueError(
        f"data source {str(path)!r}: cannot tell the format from the first line (keys {sorted(record)}); "
        "NeMo manifests need 'audio_filepath', lhotse cuts 'type'; or set DataSource(kind=...)"
    )


def nemo_line_to_cut(record: dict, cut_id: str, manifest_dir: Path, bad: BadSamples) -> MonoCut | None:
    """One NeMo manifest line -> MonoCut (reads only the audio header). None when skipped."""
    for key in ("audio_filepath", "text"):
        if key not in record:
            bad.report(cut_id, key, "missing from the manifest line", f"add '{key}' to every line")
            return None
    path = Path(record["audio_filepath"]).expanduser()
    if not path.is_absolute():
        path = manifest_dir / path
    if not path.is_file():
        bad.report(cut_id, "audio_filepath", f"audio file {str(path)!r} does not exist",
                   "fix the path (relative paths are resolved against the manifest's directory)")
        return None
    try:
        recording = Recording.from_file(path, recording_id=str(path))
    except Exception as e:  # noqa: BLE001 - any decoder failure means the file is unusable
        bad.report(cut_id, "audio_filepath", f"audio file {str(path)!r} is unreadable ({type(e).__name__}: {e})",
                   "re-encode the file as wav or flac")
        return None
    offset = float(record.get("offset") or 0.0)
    duration = record.get("duration")
    duration = recording.duration - offset if duration is None else float(duration)
    extras = {k: v for k, v in record.items() if k not in NEMO_KEYS}
    return _make_cut(cut_id, recording, offset, duration, record["text"], record.get("lang"), extras)


def _make_cut(cut_id, recording, start, duration, text, language, custom) -> MonoCut:
    supervision = SupervisionSegment(
        id=cut_id, recording_id=recording.id if recording is not None else cut_id, start=0.0,
        duration=duration, channel=0, text=text, language=language,
    )
    return MonoCut(id=cut_id, start=start, duration=duration, channel=0, recording=recording,
                   supervisions=[supervision], custom=dict(custom) or None)


class NemoManifest:
    """Lazy, re-iterable NeMo manifest reader yielding MonoCuts (bad lines go to ``bad``)."""

    def __init__(self, path: str | Path, bad: BadSamples | None = None):
        self.path = Path(path)
        self.bad = bad if bad is not None else BadSamples(skip=False)

    def __iter__(self) -> Iterator[MonoCut]:
        manifest_dir = self.path.parent
        with open(self.path) as f:
            for index, line in enumerate(f):
                if not line.strip():
                    continue
                default_id = f"{self.path.stem}-{index:08d}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    self.bad.report(default_id, "<line>", f"not valid JSON ({e})", "fix or remove the line")
                    continue
                cut = nemo_line_to_cut(record, str(record.get("id", default_id)), manifest_dir, self.bad)
                if cut is not None:
                    yield cut


class HFDatasetCuts:
    """Lazy, re-iterable view of a ``datasets.Dataset`` as MonoCuts (audio is not decoded by ``datasets``)."""

    def __init__(self, dataset, *, audio_column: str | None = "audio", text_column: str = "text",
                 context_column: str | None = "context", id_column: str | None = None, name: str = "hf",
                 bad: BadSamples | None = None):
        if audio_column is not None and audio_column in dataset.column_names:
            from datasets import Audio

            if isinstance(dataset.features.get(audio_column), Audio):
                dataset = dataset.cast_column(audio_column, Audio(decode=False))
        elif audio_column is not None:
            raise ValueError(f"HF dataset has no audio column {audio_column!r} (columns: {dataset.column_names});"
                             " set audio_column (None for text-only data)")
        if text_column not in dataset.column_names:
            raise ValueError(f"HF dataset has no text column {text_column!r} (columns: {dataset.column_names})")
        self.dataset = dataset
        self.audio_column, self.text_column = audio_column, text_column
        self.context_column = context_column if context_column in dataset.column_names else None
        self.id_column, self.name = id_column, name
        self.bad = bad if bad is not None else BadSamples(skip=False)

    def __iter__(self) -> Iterator[MonoCut]:
        for index, row in enumerate(self.dataset):
            cut_id = str(row[self.id_column]) if self.id_column else f"{self.name}-{index:08d}"
            custom = {"context": row[self.context_column]} if self.context_column else {}
            text = row[self.text_column]
            if self.audio_column is None:
                yield _make_cut(cut_id, None, 0.0, 0.0, text, None, custom)
                continue
            recording = self._recording(cut_id, row[self.audio_column])
            if recording is not None:
                yield _make_cut(cut_id, recording, 0.0, recording.duration, text, None, custom)

    def _recording(self, cut_id: str, audio) -> Recording | None:
        try:
            if isinstance(audio, str):
                audio = {"path": audio}
            if not isinstance(audio, dict):
                raise TypeError(f"expected a path or a dict, got {type(audio).__name__}")
            if audio.get("bytes"):
                return Recording.from_bytes(audio["bytes"], recording_id=cut_id)
            if audio.get("array") is not None:
                buffer = io.BytesIO()
                sf.write(buffer, np.asarray(audio["array"], dtype=np.float32), int(audio["sampling_rate"]),
                         format="WAV", subtype="FLOAT")
                return Recording.from_bytes(buffer.getvalue(), recording_id=cut_id)
            if audio.get("path"):
                path = Path(audio["path"])
                if not path.is_file():
                    self.bad.report(cut_id, self.audio_column, f"audio file {str(path)!r} does not exist",
                                    "fix the path in the dataset")
                    return None
                return Recording.from_file(path, recording_id=cut_id)
            raise ValueError("the dict has none of 'bytes', 'array', 'path'")
        except Exception as e:  # noqa: BLE001 - reported with the cut id
            self.bad.report(cut_id, self.audio_column, f"audio is unreadable ({type(e).__name__}: {e})",
                            "store a path, encoded bytes, or {'array', 'sampling_rate'}")
            return None


def open_source(source: DataSource | str | Path, bad: BadSamples | None = None) -> CutSet:
    """A lazy CutSet for one source."""
    if not isinstance(source, DataSource):
        source = DataSource(path=str(source))
    bad = bad if bad is not None else BadSamples(skip=False)
    if source.hf_dataset is not None:
        dataset = source.hf_dataset
        if isinstance(dataset, (str, Path)):
            from datasets import load_from_disk

            dataset = load_from_disk(str(dataset))
        return CutSet(HFDatasetCuts(dataset, audio_column=source.audio_column, text_column=source.text_column,
                                    context_column=source.context_column, id_column=source.id_column,
                                    name=Path(str(source.path or "hf")).stem, bad=bad))
    if source.path is None:
        raise ValueError("DataSource needs path= or hf_dataset=")
    kind = source.kind or detect_kind(source.path)
    if kind == "nemo":
        return CutSet(NemoManifest(source.path, bad))
    if kind == "lhotse":
        return CutSet.from_jsonl_lazy(source.path)
    raise ValueError(f"DataSource.kind must be 'nemo', 'lhotse' or None, got {kind!r}")


def mix_sources(sources: Sequence[DataSource | str | Path], *, seed: int = 0,
                bad: BadSamples | None = None) -> CutSet:
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
