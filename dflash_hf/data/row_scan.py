"""Every row of a manifest or cuts file checked once before training (the pre-flight), in parallel for a large plain
file, and remembered in the process (docs/PERFORMANCE.md, "Manifest pre-flight").

- :func:`check_rows` (`open_source` calls it): the rows are read as their reader reads them (`NemoManifest`,
  `LhotseCuts`; no audio). Strict: the first bad row raises `BadSampleError`; with skipping, the bad rows are counted in
  the `BadSamples` given. The result is remembered by the file's identity (resolved path, size, modification time) and
  the reading policy, so opening the source again (the trainer's loaders after `dflash-train`'s pre-flight) reads
  nothing.
- A plain (not gzipped) file of `PARALLEL_MIN_BYTES` or more is read in parts, at line boundaries, by worker processes
  (one per CPU core this process may use): each part's lines are counted first, so every message names its line in
  the file. Memory stays flat: the parts are streamed and only the bad rows come back.
- :func:`remembered_scans` / :func:`remember_scans` hand one process's results to the others of a process group
  (`training/row_preflight.py`: rank 0 reads, every rank reuses).
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_hf.data.bad_samples import SKIP_HINT, BadSampleError, BadSamples, bad_sample_message, sample_label
from dflash_hf.data.json_rows import Span, detect_kind

Source = Any  # a `sources.DataSource` (not imported: `sources.open_source` calls this module)
ReaderFactory = Callable  # `sources.file_reader(source, bad, span)`: the reader of a file source, or of part of it

PARALLEL_MIN_BYTES = 32 << 20  # about 250k NeMo rows: below, one process reads the file in a second or two
PART_BYTES = 16 << 20  # the smallest part a worker reads
ScanKey = tuple
_SCANS: dict[ScanKey, dict[str, str]] = {}  # file identity and policy -> its bad rows (label -> message)


class RecordedRows(BadSamples):
    """Bad rows recorded (label -> message) without a warning; strict, the first raises. The `BadSamples` a scan is
    applied to warns once per row (`add_skipped`)."""

    def report(self, cut_id, field: str, problem: str, fix: str, *, origin: str | None = None) -> None:
        if not self.skip:
            super().report(cut_id, field, problem, fix, origin=origin)
        message = bad_sample_message(cut_id, field, problem, fix, origin)
        self.skipped.setdefault(sample_label(cut_id, origin), message)


def scan_key(source: Source) -> ScanKey | None:
    """What a scan of `source` depends on: the file (resolved path, size, modification time) and the reading
    policy. None for sources that are not files (HF datasets) and for a file that cannot be read (its reader says)."""
    if source.hf_dataset is not None or source.path is None:
        return None
    try:
        path = Path(source.path).expanduser().resolve()
        info = path.stat()
    except OSError:
        return None
    policy = (source.kind, source.allow_command_audio_sources, source.allow_url_audio_sources)
    return (str(path), info.st_size, info.st_mtime_ns, *policy, source.max_chars_per_second)


def check_rows(
    source: Source,
    reader: ReaderFactory,
    bad: BadSamples | None = None,
    *,
    skip: bool | None = None,
    workers: int | None = None,
) -> dict[str, str]:
    """Check every row of `source` once in this process (remembered: see the module), read by `reader`'s readers;
    returns its bad rows. `bad`: strict, the first bad row raises; skipping, they are counted there. Without `bad`,
    `skip` says which (and nothing is counted: a pre-flight). `workers`: processes for a large file (default: the
    usable CPU cores)."""
    skip = bad.skip if bad is not None else bool(skip)
    key = scan_key(source)
    skipped = _SCANS.get(key) if key is not None else None
    if skipped is None:
        skipped = scan_rows(source, reader, skip=skip, workers=workers)
        if key is not None:
            _SCANS[key] = skipped
    if skipped and not skip:  # remembered from a scan that skipped them
        raise BadSampleError(f"{next(iter(skipped.values()))} ({SKIP_HINT})")
    if bad is not None:
        bad.add_skipped(skipped)
    return skipped


def scan_rows(source: Source, reader: ReaderFactory, *, skip: bool, workers: int | None = None) -> dict[str, str]:
    """Read every row of `source` as its reader does (no audio) and return the bad ones (label -> message, in file
    order); strict (`skip` False): the first raises `BadSampleError`. A large plain file is read in parallel parts."""
    source = dataclasses.replace(source, kind=source.kind or detect_kind(source.path))
    workers = workers or usable_cores()
    parts = file_parts(source.path, workers)
    if len(parts) < 2:
        return _scan_part((reader, source, None, skip))
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with context.Pool(min(workers, len(parts))) as pool:  # leaving the block ends the workers, whatever happened
        counts = pool.map(_count_lines, [(source.path, start, end) for start, end in parts])
        firsts = itertools.accumulate([0, *counts[:-1]])
        tasks = [(reader, source, (start, end, first), skip) for (start, end), first in zip(parts, firsts)]
        skipped: dict[str, str] = {}
        for found in pool.imap(_scan_part, tasks):  # in file order: strict, the first bad row of the file raises
            skipped.update(found)
    return skipped


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def file_parts(path: str | Path, workers: int) -> list[tuple[int, int]]:
    """Byte ranges of a plain file, each starting at a line start, for `workers` processes (4 parts each, at least
    `PART_BYTES` a part); one range (or none, for a gzipped file or one below `PARALLEL_MIN_BYTES`) when it is not
    worth it."""
    size = Path(path).stat().st_size
    if workers < 2 or size < PARALLEL_MIN_BYTES:
        return []
    with open(path, "rb") as f:
        if f.read(2) == b"\x1f\x8b":  # gzip: read as one stream
            return []
        count = max(1, min(4 * workers, size // PART_BYTES))
        starts = [0]
        for i in range(1, count):
            f.seek(max(i * size // count - 1, starts[-1]))
            f.readline()  # to the start of the next line
            if f.tell() < size and f.tell() > starts[-1]:
                starts.append(f.tell())
    return list(zip(starts, [*starts[1:], size]))


def _count_lines(task: tuple[str, int, int]) -> int:
    path, start, end = task
    lines = 0
    with open(path, "rb") as f:
        f.seek(start)
        while start < end:
            block = f.read(min(8 << 20, end - start))
            if not block:
                break
            lines += block.count(b"\n")
            start += len(block)
    return lines


def _scan_part(task: tuple[ReaderFactory, Source, Span | None, bool]) -> dict[str, str]:
    reader, source, span, skip = task
    recorded = RecordedRows(skip=skip)
    reader(source, recorded, span).check()
    return recorded.skipped


def remembered_scans() -> dict[ScanKey, dict[str, str]]:
    """This process's scans (for `remember_scans` in another process of the group)."""
    return dict(_SCANS)


def remember_scans(scans: dict[ScanKey, dict[str, str]]) -> None:
    _SCANS.update(scans)


__all__ = ["check_rows", "file_parts", "remember_scans", "remembered_scans", "scan_key", "scan_rows"]
