"""The frozen target's training forward replayed as a CUDA graph (`target_cuda_graph`).

The target's forward in a training step is eager transformers code: hundreds of kernels launched from Python, tap
hooks, mask helpers. On a GPU that host work takes longer than the kernels for the shapes a draft trains on (the
1.7B text step's target side: about 33 ms of host time beside 12 ms of kernels, docs/PERFORMANCE.md), and the draft's
own step waits behind it. A batch *signature* (the shapes, dtypes and devices of the batch's tensors, its other
values, the tapped layers, whether final states are kept and whether it has padding) seen a second time is
captured once as a CUDA graph, whose replays launch the same kernels with no Python in between:

- inputs are copied into the graph's fixed tensors (device to device) before each replay, and the outputs (taps,
  final states, encoder frames) are copied out after it, so no caller ever holds a graph's own buffers;
- all graphs of a target share one memory pool (they never run concurrently), so the pool holds one forward's
  intermediates, not one per signature; at most `MAX_GRAPHS` signatures are kept, the least recently used dropped;
- a signature seen once runs eagerly: padded speech batches whose widths never repeat pay nothing for the option.

A graph replays the same kernels as the eager forward, so taps and labels do not change (checked on the GPU:
tests/gpu). Only forwards that make no host read can be captured: targets of a family marked `graph_capturable`
whose decoder mask may be prebuilt (`FrozenTarget.padded_decoder_mask_applies`); under the default a capture that
fails anyway falls back to the eager forward with a warning, for that target from then on.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch

from .draft_graph import built_or_fallback, capture_graph
from .target import TargetFeatures

MAX_GRAPHS = 8  # batch signatures kept per target (the least recently used dropped first)
MAX_SIGHTINGS_KEPT = 4096  # signatures counted before the counts start over (widths that never repeat)
_FAILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target models whose capture failed (default)


def graph_blocker(ft, device: torch.device) -> str | None:
    """Why `ft`'s (a `FrozenTarget`) training forward on `device` cannot be captured as a CUDA graph, or None."""
    if device.type != "cuda":
        return f"training runs on {device}, not a GPU"
    if not ft.family.graph_capturable:
        return (f"the {ft.family.name!r} family's forward reads values back to the host (its audio encoder, "
                "transformers' checks), which a CUDA graph cannot capture")
    if not ft.padded_decoder_mask_applies():
        return ("the target's decoder builds its own mask (not an sdpa decoder of a checked model type with full "
                "attention in every layer), reading it back to the host")
    return None


def forward_graphs(setting: bool | None, ft, device: torch.device) -> TargetForwardGraphs | None:
    """`target_cuda_graph` for `ft` trained on `device`: True = always (refused, naming why, where `graph_blocker`
    says it cannot run), None = where it can run (a GPU, a capturable family and decoder), False = never."""
    if setting is False:
        return None
    why = graph_blocker(ft, device)
    if why is not None:
        if setting:
            raise ValueError(f"target_cuda_graph=True: {why}. Set target_cuda_graph to false (or leave it unset: the "
                             "eager forward then runs where a graph cannot)")
        return None
    return TargetForwardGraphs(setting)


def _signature(ft, batch: dict, layer_ids: list[int], keep_final: bool, padded: bool | None):
    """The key of a batch's captured forward, or None when it cannot be captured (a tensor off the target's device,
    a value that is not hashable)."""
    items = []
    for name, value in sorted(batch.items()):
        if torch.is_tensor(value):
            if value.device != ft.device:
                return None
            items.append((name, tuple(value.shape), value.dtype))
        else:
            try:
                hash(value)
            except TypeError:
                return None
            items.append((name, value))
    return tuple(items), tuple(layer_ids), keep_final, padded


class CapturedForward:
    """One batch signature's forward as a CUDA graph over fixed input tensors."""

    def __init__(self, ft, batch: dict, layer_ids: list[int], keep_final: bool, padded: bool | None, pool):
        self.device = ft.device
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, updated in place by later replays
            self.inputs = {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
            self.graph, self.outputs = capture_graph(
                ft.device, lambda: ft.features(self.inputs, layer_ids, keep_final, padded), pool=pool)

    def replay(self, batch: dict) -> TargetFeatures:
        """The features of `batch` (of this signature), copied out of the graph's outputs."""
        for name, fixed in self.inputs.items():
            if torch.is_tensor(fixed):
                fixed.copy_(batch[name])
        with torch.cuda.device(self.device):
            self.graph.replay()
        out = self.outputs
        return TargetFeatures(*(None if t is None else t.clone()
                                for t in (out.taps, out.final_hidden, out.encoder_hidden)))


class TargetForwardGraphs:
    """A target's captured forwards, by batch signature (see the module docstring); `FrozenTarget.forward_graphs`."""

    def __init__(self, setting: bool | None):
        self.setting = setting
        self.graphs: dict = {}  # signature -> CapturedForward, in order of use
        self.sightings: Counter = Counter()
        self.pool = None
        self.replays = 0

    def features(self, ft, batch: dict, layer_ids: list[int], keep_final: bool, padded: bool | None) -> TargetFeatures:
        """`FrozenTarget.capture`'s features of `batch`: replayed, captured now (the signature's second sighting),
        or eager."""
        key = None if ft.model in _FAILED else _signature(ft, batch, layer_ids, keep_final, padded)
        graph = None if key is None else self.graphs.pop(key, None)
        if graph is None and key is not None:
            if len(self.sightings) >= MAX_SIGHTINGS_KEPT:
                self.sightings.clear()
            self.sightings[key] += 1
            if self.sightings[key] >= 2:
                graph = self._capture(ft, batch, layer_ids, keep_final, padded)
        if graph is None:
            return ft.features(batch, layer_ids, keep_final, padded)
        self.graphs[key] = graph  # the most recently used last
        self.replays += 1
        return graph.replay(batch)

    def _capture(self, ft, batch, layer_ids, keep_final, padded) -> CapturedForward | None:
        while len(self.graphs) >= MAX_GRAPHS:
            self.graphs.pop(next(iter(self.graphs)))
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return built_or_fallback(
            self.setting, _FAILED, ft.model, lambda model: self.graphs.clear(),
            lambda: CapturedForward(ft, batch, layer_ids, keep_final, padded, self.pool),
            "the target's training forward as a CUDA graph", "the eager forward",
            "target_cuda_graph=false skips the attempt")


__all__ = ["CapturedForward", "MAX_GRAPHS", "TargetForwardGraphs", "forward_graphs", "graph_blocker"]
