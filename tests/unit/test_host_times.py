"""`HostTimes`: the per-step host timings a training log gets beside the loss (data wait, block planning, step)."""

from __future__ import annotations

from dflash_hf.reporting import HostTimes


def test_means_per_step_over_a_window_then_a_new_window(monkeypatch):
    clock = iter([100.0, 100.1, 100.12, 100.13, 100.2, 100.23, 100.5, 101.0])
    monkeypatch.setattr("dflash_hf.reporting.time.perf_counter", lambda: next(clock))
    times = HostTimes()  # the window starts at 100.0
    assert times.fetch(iter(range(5)), 2) == [0, 1]  # waited 100.1 -> 100.12
    times.planned()  # planned until 100.13
    assert times.fetch(iter([7]), 3) == [7]  # fewer at the end; waited 100.2 -> 100.23
    times.planned()  # planned until 100.5
    got = times.entries()  # at 101.0: 2 steps
    assert got == {"data_wait_ms": 25.0, "plan_ms": 140.0, "step_ms": 500.0}, got
    assert times.entries() == {}  # no step since: no entries (the clock is not read again)
