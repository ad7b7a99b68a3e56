"""Timing a step: CUDA events or wall clock, the pipelined rate, a profiler table, the matmul ceiling."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, warmup: int, steps: int) -> list[float]:
    """Per-call milliseconds (CUDA events on GPU, perf_counter on CPU) after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    sync_device(device)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def pipelined_ms(fn, device: torch.device, steps: int) -> float:
    """Mean milliseconds per call of `steps` back-to-back calls with one synchronization at the end: the rate
    of a training loop that never waits for the device between steps."""
    sync_device(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync_device(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def profile_steps(fn, steps: int, path: Path) -> dict:
    """`torch.profiler` over `steps` calls: writes the operator table (by device time) to `path`, returns the
    device-busy milliseconds per step (sum of kernel times) next to the wall milliseconds per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()  # listed in host_waits under profile_steps
    wall = (time.perf_counter() - t0) * 1e3 / steps
    events = prof.key_averages()
    tables = [
        events.table(sort_by=key, row_limit=50, max_name_column_width=90)
        for key in ("self_device_time_total", "cpu_time_total")
    ]
    path.write_text("\n\n".join(tables))
    return {
        "profiled_wall_ms": round(wall, 3),
        "device_busy_ms": round(device_busy_us(events) / 1e3 / steps, 3),
        "host_waits": host_waits(prof.events()),
    }


def device_busy_us(events) -> float:
    """Microseconds the GPU spent in kernels (and copies) among a profile's `key_averages()`."""
    return sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)


def host_waits(events) -> dict[str, dict]:
    """Every host wait for the device inside the profiled steps (`cudaStreamSynchronize`, `cudaEventSynchronize`,
    `cudaDeviceSynchronize`): its operator chain, innermost Python frames and the top-level operator that ran
    just before it on the same thread (the site when no Python frame is recorded), with count and total ms.
    This finds waits that the CUDA sync debug mode does not flag."""
    top = sorted(
        (e for e in events if e.cpu_parent is None and e.device_type == torch.autograd.DeviceType.CPU),
        key=lambda e: e.time_range.start,
    )
    waits: dict[str, dict] = {}
    for e in events:
        if e.name not in ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize"):
            continue
        chain, parent, stack, root = [e.name], e.cpu_parent, [], e
        while parent is not None:
            chain.append(parent.name)
            stack = stack or [f for f in parent.stack if "torch/profiler" not in f][:6]
            root, parent = parent, parent.cpu_parent
        before = [t.name for t in top if t.thread == root.thread and t.time_range.end <= root.time_range.start]
        key = " <- ".join(chain[:5]) + " @ " + " | ".join(stack) + " after " + " > ".join(before[-3:])
        site = waits.setdefault(key, {"count": 0, "ms": 0.0})
        site["count"] += 1
        site["ms"] = round(site["ms"] + e.cpu_time_total / 1e3, 3)
    return waits


def matmul_tflops(n: int, dtype: torch.dtype, device: torch.device, warmup: int = 3, steps: int = 10) -> float:
    """Measured matmul ceiling: median TFLOP/s of an n^3 product on random data."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = statistics.median(time_ms(lambda: a @ b, device, warmup, steps))
    return 2 * n**3 / (ms * 1e-3) / 1e12
