"""Reading audio files without running programs, and refusing samples that are not audio.

lhotse picks a decoder by the file's name and falls back through several: ``*.sph`` goes to ``sph2pipe`` through an
unquoted ``shell=True`` command (whether or not ``sph2pipe`` exists, so a file named ``y;touch X;.sph`` runs
``touch X``), ``*.opus`` to an ``ffmpeg`` shell command under ``LHOTSE_LEGACY_OPUS_LOADING=1``, and anything libsndfile
cannot read to ``audioread``, which starts ``ffmpeg`` (or GStreamer). A path from a data file must not reach a
program unless the user opted in. Every header and sample read of the data layer therefore goes through
:class:`SafeAudioBackend`: libsndfile (``soundfile``, in-process; it reads wav, flac, ogg/vorbis/opus, mp3, NIST
SPHERE, aiff, ...), and only when the source opted in (``--allow_command_audio_sources true``) lhotse's in-process
decoders and ``audioread``, given an absolute path as one argument (no shell, never read as an option or a protocol).
lhotse's shell decoders (``sph2pipe``, the legacy ``ffmpeg`` opus reader) are never used.

A sample whose values are not finite or whose magnitude exceeds ``MAX_ABS_SAMPLE`` is not audio either: it would turn
the loss and every trained weight into NaN. :func:`audio_value_problem` says why (checked where the samples are read).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from io import BytesIO
from pathlib import Path

import numpy as np
from lhotse import Recording
from lhotse.audio.backend import (
    AudioBackend,
    AudioreadBackend,
    CompositeAudioBackend,
    LibsndfileBackend,
    TorchaudioDefaultBackend,
    TorchaudioFFMPEGBackend,
    TorchcodecBackend,
    audio_backend,
)

OPT_IN_FLAG = "allow_command_audio_sources"
"""The ``DataSource`` field and CLI flag that lets external decoder programs read audio (and lhotse ``command``
sources run)."""

ALLOW_PROGRAMS_KEY = "dflash_allow_command_audio"
"""``cut.custom`` key, True when the reader that made the cut was allowed to run programs for its audio; the readers
set it with :func:`mark_programs` (a value in a data file never survives); a cut without it is not allowed."""


def mark_programs(custom: dict, allow_programs: bool) -> dict:
    """``custom`` with ``ALLOW_PROGRAMS_KEY`` set when allowed and removed otherwise (in place; returned)."""
    custom.pop(ALLOW_PROGRAMS_KEY, None)
    if allow_programs:
        custom[ALLOW_PROGRAMS_KEY] = True
    return custom


MAX_ABS_SAMPLE = 100.0
"""Largest magnitude a decoded sample may have (40 dB above full scale). Integer PCM decodes to [-1, 1]; float files
hold any value, and one beyond this bound is not a recording (an uninitialised buffer, a unit mix-up)."""

_LOCK = threading.RLock()  # lhotse's backend is a process-wide setting: one read under our backend at a time


REFUSAL_FIX = (
    f"re-encode the audio as wav or flac, or pass --{OPT_IN_FLAG} true (DataSource({OPT_IN_FLAG}=True)) if you "
    "trust the data"
)


class ExternalDecoderRefused(ValueError):
    """The audio needs a decoder program (libsndfile cannot read it) and the source did not opt in. The message is the
    problem; ``REFUSAL_FIX`` the fix."""


def refusal_problem(what: str, why: str) -> str:
    return f"{what}: libsndfile cannot decode it ({why}); the other decoders run a program on it, refused by default"


def audio_path_problem(path: Path) -> str | None:
    """Why ``path`` is not an audio file one can open (None if it is a file)."""
    return audio_file_stat(path)[1]


def audio_file_stat(path: Path) -> tuple[os.stat_result | None, str | None]:
    """``(stat, None)`` of a regular file, or ``(None, why it is not an audio file one can open)``: one ``stat``."""
    try:
        info = os.stat(path)
    except ValueError:  # a path the OS cannot take (a NUL byte), as pathlib's is_file answers False
        return None, f"audio file {str(path)!r} does not exist"
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP):  # pathlib's ignored errors
            raise
        return None, f"audio file {str(path)!r} does not exist"
    if stat.S_ISDIR(info.st_mode):
        return None, f"audio path {str(path)!r} is a directory, not an audio file"
    if not stat.S_ISREG(info.st_mode):
        return None, f"audio file {str(path)!r} does not exist"
    return info, None


def _describe(path_or_fd) -> str:
    return f"audio file {str(path_or_fd)!r}" if isinstance(path_or_fd, (str, Path)) else "in-memory audio"


def _program_safe(path_or_fd):
    """An absolute path (one argument, never an option or a protocol name such as ``pipe:``) or the file object."""
    return os.path.abspath(path_or_fd) if isinstance(path_or_fd, (str, Path)) else path_or_fd


class SafeAudioBackend(AudioBackend):
    """lhotse audio backend: libsndfile; then, only when ``allow_programs``, lhotse's in-process decoders and
    audioread (without a shell). Never ``sph2pipe`` or ``ffmpeg`` through a shell."""

    def __init__(self, allow_programs: bool = False):
        self.allow_programs = allow_programs
        self.libsndfile = LibsndfileBackend()

    def _fallback(self) -> CompositeAudioBackend:
        return CompositeAudioBackend(
            [TorchcodecBackend(), TorchaudioFFMPEGBackend(), TorchaudioDefaultBackend(), AudioreadBackend()]
        )

    def _refuse(self, path_or_fd, error: Exception) -> ExternalDecoderRefused:
        return ExternalDecoderRefused(refusal_problem(_describe(path_or_fd), f"{type(error).__name__}: {error}"))

    def read_audio(self, path_or_fd, offset=0.0, duration=None, force_opus_sampling_rate=None):
        try:
            return self.libsndfile.read_audio(path_or_fd, offset=offset, duration=duration)
        except Exception as e:  # noqa: BLE001 - libsndfile's errors vary by format
            if not self.allow_programs:
                raise self._refuse(path_or_fd, e) from e
        if isinstance(path_or_fd, BytesIO):
            path_or_fd.seek(0)
        return self._fallback().read_audio(_program_safe(path_or_fd), offset=offset, duration=duration)

    def supports_info(self) -> bool:
        return True

    def info(self, path_or_fd, force_opus_sampling_rate=None):
        try:
            return self.libsndfile.info(path_or_fd)
        except Exception as e:  # noqa: BLE001
            if not self.allow_programs:
                raise self._refuse(path_or_fd, e) from e
        if isinstance(path_or_fd, BytesIO):
            path_or_fd.seek(0)
        return self._fallback().info(_program_safe(path_or_fd))


@contextmanager
def safe_audio(allow_programs: bool = False) -> Iterator[None]:
    """lhotse reads audio through :class:`SafeAudioBackend` inside the block (serialized across threads, since
    lhotse's backend is a process-wide setting)."""
    with _LOCK, audio_backend(SafeAudioBackend(allow_programs)):
        yield


def recording_from_file(path: str | Path, recording_id: str, allow_programs: bool = False) -> Recording:
    """``Recording.from_file`` reading the header with :class:`SafeAudioBackend`."""
    with safe_audio(allow_programs):
        return Recording.from_file(path, recording_id=recording_id)


def recording_from_bytes(data: bytes, recording_id: str, allow_programs: bool = False) -> Recording:
    """``Recording.from_bytes`` reading the header with :class:`SafeAudioBackend`."""
    with safe_audio(allow_programs):
        return Recording.from_bytes(data, recording_id=recording_id)


def load_audio_safely(cut) -> np.ndarray:
    """``cut.load_audio()`` through :class:`SafeAudioBackend`, allowed programs as the cut's reader recorded."""
    with safe_audio(bool((cut.custom or {}).get(ALLOW_PROGRAMS_KEY) is True)):
        return cut.load_audio()


def audio_value_problem(audio: np.ndarray) -> str | None:
    """Why decoded samples are not usable audio: non-finite values, or a magnitude above ``MAX_ABS_SAMPLE``."""
    finite = np.isfinite(audio)
    if not finite.all():
        index = int(np.argmin(finite.reshape(-1)))
        first = audio.reshape(-1)[index]
        return (
            f"holds non-finite samples ({int((~finite).sum())} of {audio.size}; the first, {first}, at sample {index})"
        )
    peak = float(np.abs(audio).max()) if audio.size else 0.0
    if peak > MAX_ABS_SAMPLE:
        return (
            f"has samples of magnitude {peak:.3g}, beyond the {MAX_ABS_SAMPLE:g} any recording holds "
            "(integer PCM decodes to [-1, 1])"
        )
    return None


VALUE_FIX = "re-export the audio from its source (values finite, normally within [-1, 1]) or remove the sample"
