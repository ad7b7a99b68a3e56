"""`HostTimes`: the per-step host timings a training log gets beside the loss (data wait, block planning, step)."""

from __future__ import annotations

from dflash_hf.training.reporting import HostTimes


def test_means_per_step_over_a_window_then_a_new_window(monkeypatch):
    clock = iter([100.0, 100.02, 100.03, 100.1, 100.13, 100.4, 100.5, 107.0, 107.2, 107.21, 107.5, 107.6, 107.7, 108.0])
    monkeypatch.setattr("dflash_hf.training.reporting.time.perf_counter", lambda: next(clock))
    times = HostTimes()
    assert times.fetch(iter(range(5)), 2) == [0, 1]  # the window starts at this fetch (100.0); waited until 100.02
    times.planned()  # planned until 100.03
    assert times.fetch(iter([7]), 3) == [7]  # fewer at the end; waited 100.1 -> 100.13
    times.planned()  # planned until 100.4
    got = times.entries()  # at 100.5: 2 steps in 0.5 s
    assert got == {"data_wait_ms": 25.0, "plan_ms": 140.0, "step_ms": 250.0}, got
    assert times.entries() == {}  # no step since: no entries (the clock is not read)
    # 6.5 s of evaluation after the log are not a step's: the next window starts at its first fetch (107.0)
    assert times.fetch(iter([]), 2) == []  # an exhausted iterator: no step
    times.planned()
    assert times.fetch(iter([1]), 1) == [1]
    times.planned()
    assert times.entries()["step_ms"] == 1000.0  # one step, 107.0 -> 108.0


def test_a_loader_that_sets_the_pace_is_warned_once_after_the_first_window(monkeypatch):
    from dflash_hf.training import callbacks

    warned = []
    monkeypatch.setattr(callbacks.logger, "warning", lambda msg, *args: warned.append(msg % args))
    cb = callbacks.LoaderPaceCallback(share=0.3)
    args = type("A", (), {"dataloader_num_workers": 0})()
    state = type("S", (), {"global_step": 20, "is_world_process_zero": True})()
    slow = {"loss": 3.0, "data_wait_ms": 75.0, "step_ms": 125.0}
    cb.on_log(args, state, None, logs=slow)  # the first window (loader start, compilation): not judged
    cb.on_log(args, state, None, logs={"eval_dev_loss": 4.0})  # an evaluation's log: not a window
    cb.on_log(args, state, None, logs={"loss": 3.0, "data_wait_ms": 30.0, "step_ms": 125.0})  # 24%: fine
    assert not warned
    cb.on_log(args, state, None, logs=slow)
    cb.on_log(args, state, None, logs=slow)
    assert len(warned) == 1 and "waited 75 of its 125 ms" in warned[0] and "now 0" in warned[0]
    assert "in the training process" in warned[0]
    other = callbacks.LoaderPaceCallback()
    for _ in range(2):
        other.on_log(type("A", (), {"dataloader_num_workers": 4})(), state, None, logs=slow)
    assert "4 loader workers do not keep up" in warned[1]
