"""The rows of a large manifest are read in parallel parts with the same verdicts as one reader (every message naming
its line in the file), and once per process: opening the source again reads nothing (`data.row_scan`)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import soundfile as sf

from dflash_hf.data import BadSampleError, BadSamples, DataSource, open_source, row_scan
from dflash_hf.data.sources import file_reader

LINE = {"audio_filepath": "a.wav", "duration": 1.0, "text": "a few words"}
BAD_AT = (0, 7, 150, 151, 398)  # 0-based line indices: the first line, parts' edges and the last


def _manifest(tmp_path, rows: int = 400, bom: bool = True) -> str:
    sf.write(tmp_path / "a.wav", np.zeros(16000, np.float32), 16000)
    lines = []
    for i in range(rows):
        row = {**LINE, "text": f"words {i}"}
        if i in BAD_AT:
            row["duration"] = -1.0 if i % 2 else float("nan")
        lines.append(json.dumps(row))
    if rows > 200:
        lines[200] = "{not json"  # a line that is not JSON
    (tmp_path / "m.json").write_bytes(("\ufeff" if bom else "").encode() + "\n".join(lines).encode())
    return str(tmp_path / "m.json")


@pytest.fixture
def small_parts(monkeypatch):
    """Read any file of 1 KB or more in parts of at least 1 KB."""
    monkeypatch.setattr(row_scan, "PARALLEL_MIN_BYTES", 1 << 10)
    monkeypatch.setattr(row_scan, "PART_BYTES", 1 << 10)


def test_parts_read_in_parallel_give_the_single_readers_verdicts(tmp_path, small_parts):
    path = _manifest(tmp_path)
    source = DataSource(path=path)
    assert len(row_scan.file_parts(path, 2)) == 8  # 4 parts a worker, each >= 1 KB, on line starts
    one = row_scan.scan_rows(source, file_reader, skip=True, workers=1)
    parallel = row_scan.scan_rows(source, file_reader, skip=True, workers=2)
    assert list(parallel.items()) == list(one.items())  # the same rows and messages, in file order
    assert [label.split(" line ")[1] for label in parallel] == ["1)", "8)", "151)", "152)", "201)", "399)"]
    assert "'m-00000150'" in next(k for k in parallel if "line 151" in k)  # ids from the line in the file
    with pytest.raises(BadSampleError, match=r"m.json line 1\): field 'duration': is NaN"):  # strict: the first
        row_scan.scan_rows(source, file_reader, skip=False, workers=2)


def test_a_source_is_read_once_per_process_and_again_when_it_changes(tmp_path, small_parts, monkeypatch):
    path = _manifest(tmp_path)
    scans = []
    real = row_scan.scan_rows
    monkeypatch.setattr(row_scan, "scan_rows", lambda *a, **k: scans.append(1) or real(*a, **k))
    monkeypatch.setattr(row_scan, "_SCANS", {})
    first, second = BadSamples(skip=True), BadSamples(skip=True)
    open_source(path, first)
    open_source(path, second)  # the trainer's loaders after the pre-flight
    assert len(scans) == 1 and first.skipped == second.skipped and first.num_skipped == 6
    with pytest.raises(BadSampleError, match=r"line 1\): field 'duration'"):  # remembered skips, read strictly
        open_source(path, BadSamples(skip=False))
    _manifest(tmp_path, rows=300)  # edited: read again
    assert open_source(path, BadSamples(skip=True)) is not None and len(scans) == 2


def test_a_small_or_gzipped_file_is_read_as_one_stream(tmp_path, monkeypatch):
    path = _manifest(tmp_path, rows=20)
    assert row_scan.file_parts(path, 8) == []  # below PARALLEL_MIN_BYTES
    monkeypatch.setattr(row_scan, "PARALLEL_MIN_BYTES", 1 << 10)
    gz = tmp_path / "m.json.gz"
    gz.write_bytes(gzip.compress(np.random.default_rng(0).bytes(4 << 10)))
    assert gz.stat().st_size > 1 << 10 and row_scan.file_parts(gz, 8) == []
