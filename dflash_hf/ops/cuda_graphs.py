"""CUDA-graph helpers shared by the frozen target's training forward and the decoding steps: capture a step, keep
a bounded set of captured steps per owner, fall back to the eager path when a capture fails under the default."""

from __future__ import annotations

import logging
import weakref

import torch

logger = logging.getLogger(__name__)


def built_or_fallback(
    setting: bool | None, failed: weakref.WeakKeyDictionary, owner, clear, build, what: str, instead: str, hint: str
):
    """`build()`; where it raises under the default (`setting` None), None with a warning (naming `instead` and, in
    `hint`, how to skip the attempt), after `clear(owner)` (its kept steps), and `owner` is remembered in `failed`
    (not tried again until `clear`) unless it ran out of memory (that call only). Asked for (`setting` True), the
    error is raised."""
    try:
        return build()
    except Exception as error:  # noqa: BLE001 (the default only: re-raised when it was asked for)
        if setting:
            raise
        clear(owner)
        why = f"{type(error).__name__}: {error}"
        if not isinstance(error, torch.OutOfMemoryError):
            failed[owner] = why
        logger.warning("%s could not run (%s); %s instead (%s)", what, why, instead, hint)
        return None


def weight_addresses(*modules) -> tuple[int, ...]:
    """Where the modules' parameters live (a captured graph reads them there)."""
    return tuple(p.data_ptr() for m in modules for p in m.parameters())


def capture_graph(device: torch.device, step, pool=None):
    """Warm `step` up twice on a side stream (allocator, library handles), then capture it as a CUDA graph on
    `device` (not necessarily the current GPU), in the memory `pool` of other graphs if given (graphs that never
    run at the same time): (the graph, the outputs its replays overwrite)."""
    with torch.cuda.device(device):
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: CUDA calls of other threads (a DataLoader's pin-memory thread) do not break the capture
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = step()
        finally:  # a failed capture_end leaves torch.cuda.graph's capture stream current: the caller's again
            torch.cuda.set_stream(main)
    return graph, out


def drop_least_recent(store: dict, too_much, keep: int = 0) -> list:
    """Drop the entries of `store` (kept in order of use, the most recent last) from the least recently used on while
    `too_much(store)` holds and more than `keep` remain; the dropped keys."""
    dropped = []
    while len(store) > keep and too_much(store):
        oldest = next(iter(store))
        del store[oldest]
        dropped.append(oldest)
    return dropped


def kept_bytes(store: dict) -> int:
    """The bytes held by the steps of `store` (their `nbytes`)."""
    return sum(step.nbytes for step in store.values())


def reused_step(store: dict, key, limit: int, serves, make):
    """The step kept in `store` under `key` while `serves(step)` holds, else a new one from `make()`; `store` keeps
    at most `limit` steps in order of use (the least recently used dropped first)."""
    step = store.pop(key, None)  # re-inserted last
    if step is None or not serves(step):
        drop_least_recent(store, lambda s: len(s) >= limit)
        step = make()
    store[key] = step
    return step
