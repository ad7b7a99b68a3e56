"""`HostTimes`: the per-step host timings a training log gets beside the loss (data wait, block planning, step)."""

from __future__ import annotations

from dflash_hf.reporting import HostTimes


def test_means_per_step_over_a_window_then_a_new_window(monkeypatch):
    clock = iter([100.0, 100.5, 101.0, 101.5])
    monkeypatch.setattr("dflash_hf.reporting.time.perf_counter", lambda: next(clock))
    times = HostTimes()  # window starts at 100.0
    times.add(0.010, 0.002)
    times.add(0.030, 0.004)
    assert times.entries() == {"data_wait_ms": 20.0, "plan_ms": 3.0, "step_ms": 250.0}  # 0.5 s over 2 steps
    assert times.entries() == {}  # no step since: no entries; the window restarts at 101.0
    times.add(0.1, 0.0)
    assert times.entries()["step_ms"] == 500.0
