"""The draft's greedy proposal as one fixed-shape step, replayed as a CUDA graph while decoding.

At batch 1 a small draft's forward is launch-bound: on the H200 a 2-layer DFlash2 Whisper draft issued about 220
kernels a cycle (`benchmarks/decode_ops.py`), each a few microseconds of work behind tens of microseconds of Python
and launch overhead. :class:`FixedDraftStep` computes the same proposal with every shape fixed, so the whole step
(embedding the block, the draft forward, the lm_head and the greedy proposal, DFlash2's selector walk included) can
be captured once and replayed as one graph:

- the draft's KV cache is a fixed-capacity buffer per layer (:class:`FixedDraftCache`); a cycle writes the keys and
  values of ``S = block_size`` context rows at positions ``start .. start+S-1`` (the rows past the valid ones are
  written too and masked out: the next cycle overwrites them) and attends to the whole buffer through a mask that
  keeps positions ``< a``, the anchor's position, plus the block's own keys (the block is never written, as the eager
  loop crops it);
- the per-cycle inputs are copied into fixed tensors before the replay: the anchor id (device to device), the
  pending target features and two position scalars (``fill_``: no host-to-device copy, no synchronize);
- a prompt with more than ``S`` positions of context (text and speech-LLM targets) enters in one eager forward that
  writes all its rows into the same buffers; the cycles after it replay the graph.

Only the proposal changes (attention over a masked fixed-size buffer may round differently from attention over the
exact context), never the decoded output: verification decides every token. The same step runs without a graph on
the CPU (``draft_cuda_graph=True``), which is how the tests compare it with the eager loop.
"""

from __future__ import annotations

import logging
import weakref

import torch

from dflash_hf.generation.verify_rules import propose_block
from dflash_hf.ops.cuda_graphs import built_or_fallback, capture_graph, reused_step, weight_addresses

# Context positions beyond this many keep the eager loop (a fixed buffer attends to every position every cycle).
MAX_FIXED_POSITIONS = 16384
CAPACITY_ROUNDING = 128  # capacities are rounded up so that prompts of similar length share a captured graph
# Steps per draft, beside it rather than on it (a draft stays deep-copyable and its state dict untouched); at most
# MAX_STEPS_PER_DRAFT, the least recently used dropped first (text prompts of many lengths make many capacities).
_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
MAX_STEPS_PER_DRAFT = 8
_FAILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafts whose step failed under the default
logger = logging.getLogger(__name__)


class FixedDraftCache:
    """Fixed-capacity keys/values `[1, kv_heads, capacity, head_dim]` per draft layer, with the `update(k, v, idx)`
    of a transformers cache: the first `ctx_rows` rows of `k`/`v` (the context) are written at `write_index`, and
    the whole buffer followed by the remaining rows (the block) is returned."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        ctx_rows: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (1, kv_heads, capacity, head_dim)  # zeros: masked rows must be finite (0 * inf would be NaN)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.ctx_rows = ctx_rows
        self.rows = torch.arange(ctx_rows, device=device)  # a forward's context rows, 0-based
        self.write_index = self.rows  # their positions: set before each forward

    def with_rows(self, ctx_rows: int) -> FixedDraftCache:
        """The same buffers, taking `ctx_rows` context rows a forward (a long prompt's context in one forward)."""
        other = object.__new__(FixedDraftCache)
        other.keys, other.values, other.ctx_rows = self.keys, self.values, ctx_rows
        other.rows = other.write_index = torch.arange(ctx_rows, device=self.keys[0].device)
        return other

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.ctx_rows
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.write_index, key[:, :, :s])
        values.index_copy_(2, self.write_index, value[:, :, :s])
        return torch.cat([keys, key[:, :, s:]], dim=2), torch.cat([values, value[:, :, s:]], dim=2)


class FixedDraftStep:
    """One decode's worth of fixed tensors and the fixed-shape greedy step over them (see the module docstring).

    Its buffers are shared by every decode with the same key: one decode at a time per draft (speculative decoding
    here is batch 1 and sequential). Made by :func:`draft_step_for` (kept per draft, target, capacity and encoder
    frame shape); call :meth:`start` once per utterance (the encoder frames' keys/values of encoder-context drafts)
    and :meth:`propose` once per cycle."""

    def __init__(self, draft, target, capacity: int, frames_shape: tuple[int, ...] | None, graph: bool, head=None):
        self.head = head or greedy_head  # what the step returns from the draft's hidden block
        # Plain tensors even when made under inference mode (later decodes outside it update them in place).
        with torch.inference_mode(False), torch.no_grad():
            self._build(draft, target, capacity, frames_shape, graph)

    def _build(self, draft, target, capacity: int, frames_shape: tuple[int, ...] | None, graph: bool) -> None:
        cfg = draft.config
        # Weak references only: the store is keyed by the draft, and a step must keep neither it nor the target alive.
        self._draft, self._model = weakref.ref(draft), weakref.ref(target.model)
        self.addresses = self._addresses(draft, target)  # what a captured graph reads the weights from
        self.block = cfg.block_size
        self.capacity = capacity
        dtype = next(draft.parameters()).dtype
        device = target.device
        self.dtype, self.device = dtype, device
        s = self.block
        self.cache = FixedDraftCache(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, capacity, s, dtype, device
        )
        self.block_rows = torch.arange(s, device=device)
        self.columns = torch.arange(capacity, device=device)
        self.keep_block = torch.ones(s, dtype=torch.bool, device=device)
        self.start_pos = torch.zeros((), dtype=torch.long, device=device)  # first context row's position
        self.anchor_pos = torch.zeros((), dtype=torch.long, device=device)  # a: positions < a are the context
        self.pending = torch.zeros(1, s, cfg.num_taps * cfg.hidden_size, dtype=dtype, device=device)
        self.block_ids = torch.full((1, s), cfg.mask_token_id, dtype=torch.long, device=device)
        self.encoder_cache: dict | None = None
        self.frames = None
        if frames_shape is not None:  # keys/values per layer, refilled per utterance; the frames themselves unread
            self.encoder_cache = {}
            for layer in draft.layers:
                attn = layer.encoder_attn
                kv_shape = (1, attn.num_heads, frames_shape[1], attn.head_dim)
                self.encoder_cache[layer.self_attn.layer_idx] = tuple(
                    torch.zeros(kv_shape, dtype=dtype, device=device) for _ in range(2)
                )
            self.frames = torch.zeros(1, 0, frames_shape[2], dtype=dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.proposal: torch.Tensor | None = None
        if graph:
            self._capture(target)

    def serves(self, draft, target) -> bool:
        """Whether this step is still valid for `draft` and `target`: the same target model, and every weight where
        it was when the step was made (a dtype round trip or `load_state_dict(assign=True)` moves them)."""
        return self._model() is target.model and self.addresses == self._addresses(draft, target)

    @staticmethod
    def _addresses(draft, target) -> tuple[int, ...]:
        return weight_addresses(draft, target.embed_tokens, target.lm_head)

    def _fixed_step(self, ft) -> torch.Tensor:
        """`_step` over the fixed inputs: what the graph captures."""
        return self._step(ft, self.cache, self.pending, self.start_pos, self.anchor_pos)

    def _step(
        self,
        ft,
        cache: FixedDraftCache,
        pending: torch.Tensor,
        start_pos: torch.Tensor | int,
        anchor_pos: torch.Tensor | int,
    ) -> torch.Tensor:
        """The greedy proposal `[B-1]` (or what the step's `head` makes of the block) against the `FrozenTarget` `ft`
        of `pending` `[1, n, ...]` (the context rows at `start_pos` onwards, written through `cache`, whose `rows` are
        n), for the block at `anchor_pos`."""
        draft = self._draft()
        cache.write_index = start_pos + cache.rows  # [n]: where the context rows go
        positions = torch.cat([cache.write_index, anchor_pos + self.block_rows])[None]  # [1, n+B]
        keep = torch.cat([self.columns < anchor_pos, self.keep_block]).view(1, 1, 1, -1)  # [1,1,1,cap+B]
        hidden = draft(
            position_ids=positions,
            attention_mask=keep,
            noise_embedding=ft.embed_tokens(self.block_ids).to(self.dtype),
            target_hidden=pending,
            past_key_values=cache,
            use_cache=True,
            **(
                {}
                if self.encoder_cache is None
                else {"encoder_hidden_states": self.frames, "encoder_cache": self.encoder_cache}
            ),
        )[0]  # [B, H]
        return self.head(draft, hidden.to(ft.dtype), ft.lm_head, self.block_ids[0, 0])

    def _capture(self, ft) -> None:
        # Warm-up on a side stream (allocator and library handles), then capture, on the target's GPU (not
        # necessarily the current one); the writes land at positions >= capacity - S, which no decode reaches as
        # context before overwriting them.
        self.start_pos.fill_(self.capacity - self.block)
        self.anchor_pos.fill_(self.capacity - self.block)
        self.graph, self.proposal = capture_graph(self.device, lambda: self._fixed_step(ft))

    def start(self, encoder_frames: torch.Tensor | None) -> None:
        """Per utterance: the encoder frames' keys/values of an encoder-context draft (the context buffer needs no
        reset: positions not yet written this decode are masked)."""
        if self.encoder_cache is None:
            return
        for layer in self._draft().layers:
            k, v = layer.encoder_attn.key_values(encoder_frames)
            fixed_k, fixed_v = self.encoder_cache[layer.self_attn.layer_idx]
            fixed_k.copy_(k)
            fixed_v.copy_(v)

    def _run(self, ft, pending: torch.Tensor, start: int, anchor: torch.Tensor) -> torch.Tensor:
        n = pending.shape[1]
        self.pending[:, :n].copy_(pending)
        self.start_pos.fill_(start)
        self.anchor_pos.fill_(start + n)
        self.block_ids[:, :1].copy_(anchor)
        if self.graph is None:
            return self._fixed_step(ft)
        with torch.cuda.device(self.device):  # the current stream of the graph's GPU
            self.graph.replay()
        return self.proposal

    def propose(self, ft, pending: torch.Tensor, start: int, anchor: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens `[B-1]` (against the `FrozenTarget` `ft`, the step's target) for the block at position
        `start + pending rows`, anchored on `anchor`
        `[1, 1]` (the last verified token, on the device). `pending` `[1, n, n_taps*H]` are the target features of
        positions `start .. start+n-1`, not yet in the draft's context. The result is a fixed tensor that the next
        call overwrites."""
        n = pending.shape[1]
        if n <= self.block:
            return self._run(ft, pending, start, anchor)
        # a prompt's context longer than a block (the first cycle): one eager forward writes all of it
        self.block_ids[:, :1].copy_(anchor)
        return self._step(ft, self.cache.with_rows(n), pending.to(self.dtype), start, start + n)


def greedy_head(draft, hidden: torch.Tensor, lm_head: torch.nn.Module, anchor: torch.Tensor) -> torch.Tensor:
    """The default step head: the draft's greedy proposal `[B-1]` (`propose_block`)."""
    return propose_block(draft, hidden, lm_head, anchor, 0.0, None)[0]


def fixed_draft_step(
    setting: bool | None,
    draft,
    ft,
    block: int,
    encoder_frames: torch.Tensor | None,
    *,
    device: torch.device,
    sample: bool,
    max_positions: int | None,
    max_length: int | None,
    expansion: int,
    head=None,
) -> FixedDraftStep | None:
    """The decode's :class:`FixedDraftStep`, or None for the eager draft forward. `setting`: True = always (refused
    for sampling, an unbounded decode, more than `MAX_FIXED_POSITIONS` positions or weights on several devices; on
    the CPU without a graph), None = on a GPU where it can run (a step that fails to build or capture falls back to
    the eager forward with a warning, for this draft from then on until `clear_fixed_draft_steps`; out of memory: for
    this decode only), False = never. `device`: the decode's. `head`: what the step returns from the draft's block
    (None: the greedy proposal; `tree.TreeHead`: a token tree), hashable."""
    # `setting`: True, None or False (`DecodeOptions` checked it)
    if setting is False or (setting is None and (device.type != "cuda" or sample or draft in _FAILED)):
        return None
    limit = max_positions if max_positions is not None else None if max_length is None else max_length + expansion
    capacity = None if limit is None else fixed_capacity(limit, block)
    # a graph is captured on one device: the draft, the target's embedding and its lm_head must all be there
    spread = {p.device for m in (draft, ft.embed_tokens, ft.lm_head) for p in m.parameters()} - {device}
    if setting and (sample or capacity is None or spread):  # asked for explicitly: say why it cannot run
        why = (
            "sampling (temperature > 0)"
            if sample
            else (
                f"weights on {sorted(map(str, spread))} besides {device}"
                if spread
                else "a decode without a length bound"
                if limit is None
                else f"{limit} positions (more than the fixed step's {MAX_FIXED_POSITIONS})"
            )
        )
        raise ValueError(
            f"draft_cuda_graph=True: the fixed-shape draft step is for bounded greedy decoding, not "
            f"{why}; pass draft_cuda_graph=None (it then falls back to the eager draft) or False"
        )
    if capacity is None or spread:
        return None
    return built_or_fallback(
        setting,
        _FAILED,
        draft,
        clear_fixed_draft_steps,
        lambda: draft_step_for(draft, ft, capacity, encoder_frames, graph=device.type == "cuda", head=head),
        "the draft's fixed-shape step",
        "the eager draft forward",
        "draft_cuda_graph=False, dflash-eval --draft_cuda_graph off, skips the attempt",
    )


def fixed_capacity(limit: int, block_size: int) -> int | None:
    """Buffer positions for a decode whose decoder positions stay below `limit`: every context write (`start + S`)
    and block fits, rounded up to `CAPACITY_ROUNDING`; None when the eager loop should run instead."""
    if limit + 2 * block_size > MAX_FIXED_POSITIONS:
        return None
    need = limit + 2 * block_size
    return -(-need // CAPACITY_ROUNDING) * CAPACITY_ROUNDING


def draft_step_for(
    draft, target, capacity: int, encoder_frames: torch.Tensor | None, graph: bool, head=None
) -> FixedDraftStep:
    """The draft's :class:`FixedDraftStep` for this target, capacity, frame shape, mode and head, made once and kept
    on the draft (a capture costs a few draft forwards); `start` is called on it for these `encoder_frames`."""
    store = _STEPS.setdefault(draft, {})
    frames_shape = None if encoder_frames is None else tuple(encoder_frames.shape)
    key = (id(target.model), target.device, next(draft.parameters()).dtype, capacity, frames_shape, graph, head)
    step = reused_step(
        store,
        key,
        MAX_STEPS_PER_DRAFT,
        lambda s: s.serves(draft, target),
        lambda: FixedDraftStep(draft, target, capacity, frames_shape, graph, head),
    )
    step.start(encoder_frames)
    return step


def fixed_draft_steps(draft) -> dict:
    """The steps made for `draft` so far (keyed by target, device, dtype, capacity, frame shape, mode and head)."""
    return _STEPS.get(draft, {})


def clear_fixed_draft_steps(draft) -> None:
    """Drop `draft`'s steps and their buffers (and CUDA graphs), and forget a failure under the default."""
    _STEPS.pop(draft, None)
    _FAILED.pop(draft, None)


__all__ = [
    "FixedDraftCache",
    "FixedDraftStep",
    "fixed_draft_step",
    "fixed_capacity",
    "draft_step_for",
    "fixed_draft_steps",
    "clear_fixed_draft_steps",
    "MAX_FIXED_POSITIONS",
]
