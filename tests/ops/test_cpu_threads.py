"""Torch's CPU threads per process: the cores this process may use, shared and less the busy ones."""

from __future__ import annotations

from dflash_hf.ops import cpu_threads


def test_cpu_threads_share_the_free_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads.cpu_threads() == 3  # the override wins
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda _: set(range(8)), raising=False)
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert cpu_threads.cpu_threads() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_threads.cpu_threads() == 4  # two ranks on this machine
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert cpu_threads.cpu_threads(max_threads=1) == 1  # the demo's tiny models
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (6.6, 0.0, 0.0))
    assert cpu_threads.cpu_threads() == 1  # a busy machine: do not oversubscribe
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (20.0, 0.0, 0.0))
    assert cpu_threads.cpu_threads() == 1
