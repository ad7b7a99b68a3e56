"""The frozen target's training forward replayed as a CUDA graph (`target_cuda_graph`).

The target's forward in a training step is eager transformers code: hundreds of kernels launched from Python, tap
hooks, mask helpers. On a GPU that host work takes longer than the kernels for the shapes a draft trains on (the
1.7B text step's target forward: 26 ms eager, 11 ms replayed, docs/PERFORMANCE.md), and the draft's own step waits
behind it. A batch *signature* (the shapes and dtypes of the tensors the target reads, its other forward values, the
tapped layers, whether final states are kept, and the host's facts about padding and packed documents) seen a
second time is captured once as a CUDA graph, whose replays launch the same kernels with no Python in between:

- the tensors the target reads are copied into the graph's fixed tensors (device to device) before each replay, and
  the outputs (taps, final states, encoder frames) are copied out after it, so no caller holds a graph's buffers;
- all graphs of a target share one memory pool (they never run concurrently), so the pool holds one forward's
  intermediates, not one per signature; each kept graph also keeps its inputs and outputs allocated (taps of every
  position: 0.4 GiB for 64 x 256 tokens of a 5-tap 2048-wide target), at most `MAX_GRAPHS` graphs and
  `MAX_KEPT_BYTES` of them, the least recently used dropped first;
- a signature seen once runs eagerly (padded speech batches whose widths never repeat pay nothing), and each
  signature is captured at most once: one dropped to make room runs eagerly from then on, so shapes that cycle
  through more signatures than are kept never recapture;
- the first failure stops capturing for the target (with one warning; under `target_cuda_graph=True` it is raised).

A graph replays the same kernels as the eager forward, so taps and labels do not change (checked on the GPU:
tests/gpu). Only forwards that make no host read can be captured: targets of a family marked `graph_capturable`
whose decoder mask may be prebuilt (`FrozenTarget.padded_decoder_mask_applies`).
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter

import torch

from dflash_hf.ops.cuda_graphs import built_or_fallback, capture_graph, drop_least_recent, kept_bytes
from dflash_hf.targets.frozen import NON_TARGET_KEYS, TargetFeatures

MAX_GRAPHS = 8  # batch signatures kept per target (the least recently used dropped first)
MAX_KEPT_BYTES = 4 << 30  # and at most this many bytes of their fixed inputs and outputs together
MAX_SIGHTINGS_KEPT = 4096  # signatures counted before the counts start over (widths that never repeat)
_FAILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target models whose capture failed (default)
# Batch keys the target's forward reads besides its model inputs (`FrozenTarget.target_inputs`: the packed layout).
PACKED_KEYS = ("cu_seqlens", "max_seqlen")
logger = logging.getLogger(__name__)


def graph_blocker(ft, device: torch.device) -> str | None:
    """Why `ft`'s (a `FrozenTarget`) training forward on `device` cannot be captured as a CUDA graph, or None."""
    if device.type != "cuda":
        return f"training runs on {device}, not a GPU"
    if not ft.family.graph_capturable:
        return (
            f"the {ft.family.name!r} family's forward reads values back to the host (its audio encoder, "
            "transformers' checks), which a CUDA graph cannot capture"
        )
    if not ft.padded_decoder_mask_applies():
        return (
            "the target's decoder builds its own mask (not an sdpa decoder of a checked model type with full "
            "attention in every layer), reading it back to the host"
        )
    return None


def forward_graphs(setting: bool | None, ft, device: torch.device) -> TargetForwardGraphs | None:
    """`target_cuda_graph` for `ft` trained on `device`: True = always (refused, naming why, where `graph_blocker`
    says it cannot run), None = where it can run (a GPU, a capturable family and decoder), False = never."""
    if setting is False:
        return None
    why = graph_blocker(ft, device)
    if why is not None:
        if setting:
            raise ValueError(
                f"target_cuda_graph=True: {why}. Set target_cuda_graph to false (or leave it unset: the "
                "eager forward then runs where a graph cannot)"
            )
        return None
    return TargetForwardGraphs(setting)


def target_read(batch: dict) -> dict:
    """The batch entries the target's forward reads: its model inputs and the packed layout (not the loss mask,
    labels or document ids of the draft's side)."""
    return {k: v for k, v in batch.items() if k not in NON_TARGET_KEYS or k in PACKED_KEYS}


def _signature(ft, batch: dict, layer_ids: list[int], keep_final: bool, padded: bool | None):
    """The key of a batch's captured forward, or the reason it cannot be captured (a str: a tensor off the target's
    device, a value that is not hashable). `max_seqlen` is not part of it: the forward reads it only to decide
    whether a packed row needs a mask (`FrozenTarget.unmasked_causal`), which the key holds."""
    items = []
    for name, value in sorted(target_read(batch).items()):
        if torch.is_tensor(value):
            if value.device != ft.device:
                return f"its {name!r} is on {value.device}, not on the target's {ft.device}"
            items.append((name, tuple(value.shape), value.dtype))
        elif name != "max_seqlen":
            try:
                hash(value)
            except TypeError:
                return f"its {name!r} is a {type(value).__name__}, which a graph's key cannot hold"
            items.append((name, value))
    return tuple(items), tuple(layer_ids), keep_final, padded, ft.unmasked_causal(batch, padded)


class CapturedForward:
    """One batch signature's forward over fixed input tensors: a CUDA graph (`graph`), or on the CPU the same forward
    run on the fixed tensors each time (how the tests check what a replay reads)."""

    def __init__(
        self, ft, batch: dict, layer_ids: list[int], keep_final: bool, padded: bool | None, pool, graph: bool = True
    ):
        self.device = ft.device
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, updated in place by later replays
            self.inputs = {k: v.clone() if torch.is_tensor(v) else v for k, v in target_read(batch).items()}
            self.step = lambda: ft.features(self.inputs, layer_ids, keep_final, padded)
            self.graph, self.outputs = capture_graph(ft.device, self.step, pool=pool) if graph else (None, self.step())
        tensors = [*self.inputs.values(), *self.outputs.__dict__.values()]
        self.nbytes = sum(t.nbytes for t in tensors if torch.is_tensor(t))

    def replay(self, batch: dict) -> TargetFeatures:
        """The features of `batch` (of this signature), copied out of the graph's outputs."""
        for name, fixed in self.inputs.items():
            if torch.is_tensor(fixed):
                fixed.copy_(batch[name])
        if self.graph is None:  # under FrozenTarget.capture's no_grad
            self.outputs = self.step()
        else:
            with torch.cuda.device(self.device):
                self.graph.replay()
        out = self.outputs
        return TargetFeatures(
            *(None if t is None else t.clone() for t in (out.taps, out.final_hidden, out.encoder_hidden))
        )


class TargetForwardGraphs:
    """A target's captured forwards, by batch signature (see the module docstring); `FrozenTarget.forward_graphs`."""

    def __init__(self, setting: bool | None):
        self.setting = setting
        self.graphs: dict = {}  # signature -> CapturedForward, in order of use
        self.sightings: Counter = Counter()  # signatures seen, not captured yet
        self.dropped: set = set()  # signatures captured once and dropped: eager from then on
        self.pool = None
        self.stopped = False  # a capture failed (or ran out of memory): eager from then on
        self.replays = 0

    def features(self, ft, batch: dict, layer_ids: list[int], keep_final: bool, padded: bool | None) -> TargetFeatures:
        """`FrozenTarget.capture`'s features of `batch`: replayed, captured now (the signature's second sighting),
        or eager."""
        key = None if self.stopped or ft.model in _FAILED else _signature(ft, batch, layer_ids, keep_final, padded)
        if isinstance(key, str):
            if self.setting:
                raise ValueError(
                    f"target_cuda_graph=True: this batch cannot be captured: {key}. Leave "
                    "target_cuda_graph unset (such batches then run eagerly) or set it to false"
                )
            key = None
        graph = None if key is None else self.graphs.pop(key, None)
        if graph is None and key is not None and key not in self.dropped:
            if len(self.sightings) >= MAX_SIGHTINGS_KEPT:
                self.sightings.clear()
            self.sightings[key] += 1
            if self.sightings[key] >= 2:
                del self.sightings[key]
                graph = self._capture(ft, batch, layer_ids, keep_final, padded)
        if graph is None:
            return ft.features(batch, layer_ids, keep_final, padded)
        self.graphs[key] = graph  # the most recently used last
        self.dropped.update(
            drop_least_recent(self.graphs, lambda s: len(s) > MAX_GRAPHS or kept_bytes(s) > MAX_KEPT_BYTES, keep=1)
        )
        self.replays += 1
        return graph.replay(batch)

    def _capture(self, ft, batch, layer_ids, keep_final, padded) -> CapturedForward | None:
        on_gpu = ft.device.type == "cuda"
        if self.pool is None and on_gpu:
            self.pool = torch.cuda.graph_pool_handle()
        graph = built_or_fallback(
            self.setting,
            _FAILED,
            ft.model,
            lambda model: self.graphs.clear(),
            lambda: CapturedForward(ft, batch, layer_ids, keep_final, padded, self.pool, graph=on_gpu),
            "the target's training forward as a CUDA graph",
            "the eager forward",
            "target_cuda_graph=false skips the attempt",
        )
        self.stopped = graph is None
        if graph is not None:
            shapes = {k: tuple(v.shape) for k, v in graph.inputs.items() if torch.is_tensor(v)}
            logger.info(
                "the frozen target's forward of batches shaped %s replays as a CUDA graph from now on "
                "(target_cuda_graph; %d kept)",
                shapes,
                len(self.graphs) + 1,
            )
        return graph


__all__ = [
    "CapturedForward",
    "MAX_GRAPHS",
    "MAX_KEPT_BYTES",
    "TargetForwardGraphs",
    "forward_graphs",
    "graph_blocker",
    "target_read",
]
