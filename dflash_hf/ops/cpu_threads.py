"""Torch's CPU threads per process (the console scripts set them before any torch work): the cores this process may
use, shared by the processes of this machine and less the ones other work keeps busy, so that several processes or a
busy machine do not oversubscribe the cores (`OMP_NUM_THREADS` overrides)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("dflash_hf")

THREADS_ENV = "OMP_NUM_THREADS"


def env_int(name: str, default: int) -> int:
    """The integer environment variable `name` (`default` when unset or not an integer)."""
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def cpu_threads(max_threads: int | None = None) -> int:
    """Intra-op threads for one process: `OMP_NUM_THREADS` when set; else the cores this process may run on,
    shared by the processes of this machine (`LOCAL_WORLD_SIZE`), less the cores other work keeps busy (the
    1-minute load average), at most `max_threads`, at least 1."""
    explicit = env_int(THREADS_ENV, 0)
    if explicit > 0:
        return explicit
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_process = max(1, cores // max(env_int("LOCAL_WORLD_SIZE", 1), 1))
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    idle = int(cores - busy + 0.5)  # cores other processes leave free (this one has not started work yet)
    return max(1, min(per_process, idle, max_threads or per_process))


def configure_cpu_threads(max_threads: int | None = None) -> int:
    """Set torch's intra-op threads to :func:`cpu_threads` and return the count (console scripts call it)."""
    import torch

    n = cpu_threads(max_threads=max_threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    logger.info("using %d CPU threads per process (set %s to override)", n, THREADS_ENV)
    return n


__all__ = ["THREADS_ENV", "configure_cpu_threads", "cpu_threads", "env_int"]
