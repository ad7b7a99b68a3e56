"""The target's block verify as one fixed-shape forward, replayed as a CUDA graph (on a GPU by default).

At batch 1 the target's forward over a block is launch-bound: on the H200 it was half of a Whisper cycle once the
draft's step ran as a graph (`docs/PERFORMANCE.md`). :class:`FixedVerifyStep` runs the same forward with every shape
fixed, so it can be captured once and replayed (Whisper and decoder-only targets: text LLMs and speech LLMs, whose
prompt's audio positions are prefilled as usual):

- the self-attention keys/values live in fixed buffers per layer (:class:`FixedSelfCache`; Whisper: its 448 decoder
  positions, a decoder-only target: the decode's bound rounded up); a verify writes the block's rows at its positions
  and attends to every row through a mask that keeps the rows at or before each query's position. Rows of rejected
  tokens lie past the next anchor and are overwritten by the next block before any query reaches them, so nothing is
  cropped;
- the prompt's rows (and Whisper's cross-attention keys/values and encoder output) are copied in per prompt;
- the block's ids and positions are copied into fixed tensors before each replay.

Attention over the masked fixed buffers may round differently from attention over the growing cache, so greedy decoding
stays `generate`'s unless a rounding flips a near-tie. Measured (`docs/PERFORMANCE.md`): no argmax of 2440 Whisper-base
block positions differed on the CPU or on an H200 (whose logits were equal to the bit), nor of 1488 on SmolLM2-135M
(CPU); on the H200 every output of Whisper-base and of the speech LLM of `benchmarks/speech_llm.py` equalled plain
greedy `generate` (40/40 each) at 1.4x and 1.9x the growing cache's tokens/s.
Hence the default `verify_cuda_graph=None`: on a GPU wherever it can run (:func:`fixed_verify_rows`), the growing
cache elsewhere; `dflash-eval` checks the outputs as always. On the CPU the same fixed-shape forward runs without a
graph only when asked for (how the tests compare it with the growing cache).
"""

from __future__ import annotations

import weakref

import torch
from transformers import DynamicCache, EncoderDecoderCache

from dflash_hf.generation.fixed_draft import MAX_FIXED_POSITIONS
from dflash_hf.generation.target_cache import cache_keyword
from dflash_hf.models.configuration_dflash import decoder_attends_fully
from dflash_hf.ops.cuda_graphs import (
    built_or_fallback,
    capture_graph,
    drop_least_recent,
    kept_bytes,
    reused_step,
    weight_addresses,
)

# Steps per target model, beside it (the model stays deep-copyable), at most MAX_STEPS_PER_TARGET, least recent first.
_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FAILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # models whose step failed under the default
MAX_STEPS_PER_TARGET = 4
ROW_ROUNDING = 128  # a decoder-only target's buffer rows are rounded up to this
# The default takes the fixed-shape verify only while its key/value buffers stay this small (a step is kept beside the
# model for later decodes); larger decodes keep the growing cache unless verify_cuda_graph=True.
AUTO_MAX_BUFFER_BYTES = 1 << 30


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`keep` `[q, k]` as an additive mask `[1, 1, q, k]`: 0 where kept, else the lowest value of `dtype`."""
    return torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]


class FixedSelfCache(DynamicCache):
    """Self-attention keys/values in fixed buffers `[1, heads, positions, head_dim]` per decoder layer (views of one
    `storage` tensor `[2, layers, 1, heads, positions, head_dim]`), written at `write_index` (a fixed tensor updated
    in place): a cache's `update` without growth. A `DynamicCache` only so that `EncoderDecoderCache` takes it; its
    own layers stay empty."""

    def __init__(
        self, num_layers: int, heads: int, head_dim: int, positions: int, dtype: torch.dtype, device: torch.device
    ):
        super().__init__()
        shape = (2, num_layers, 1, heads, positions, head_dim)  # zeros: masked rows must be finite (0 * inf: NaN)
        self.storage = torch.zeros(shape, dtype=dtype, device=device)  # one tensor: rows move in one operator
        self.keys, self.values = list(self.storage[0].unbind(0)), list(self.storage[1].unbind(0))
        self.columns = torch.arange(positions, device=device)
        self.write_index = self.columns[:0]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx].index_copy_(2, self.write_index, key)
        self.values[layer_idx].index_copy_(2, self.write_index, value)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are explicit: position ids, `write_index` and the mask

    def keep_mask(self, query_positions: torch.Tensor, dtype: torch.dtype, valid: torch.Tensor) -> torch.Tensor:
        """Additive `[1, 1, q, positions]`: 0 where a row's position is at or before the query's and the row is
        `valid` (not a padded prompt position), else the lowest value of `dtype`."""
        return additive_mask((self.columns[None, :] <= query_positions[:, None]) & valid[None, :], dtype)


class FixedVerifyStep:
    """One target's fixed tensors and the fixed-shape verify over them (module docstring). Made by
    :func:`verify_step_for`; :meth:`start` once per prompt, :meth:`verify` once per cycle. One decode at a time
    per target (its buffers are shared by every decode with the same key)."""

    def __init__(self, ft, layer_ids: list[int], block: int, rows: int, prefill_cache, encoder_hidden, graph: bool):
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, updated in place by later decodes
            self._build(ft, layer_ids, block, rows, prefill_cache, encoder_hidden, graph)

    def _build(self, ft, layer_ids, block, rows, prefill_cache, encoder_hidden, graph) -> None:
        dev, dtype = ft.device, ft.dtype
        self._model = weakref.ref(ft.model)
        self.addresses = weight_addresses(ft.model)
        self.layer_ids, self.block, self.dtype = list(layer_ids), block, dtype
        self.cache_key = cache_keyword(ft.model)  # `past_key_values`, or `cache` from transformers 5.24
        self.encoder_decoder = encoder_hidden is not None
        first = _self_attention(prefill_cache).layers[0].keys  # [1, kv_heads, L, head_dim]
        self.self_cache = FixedSelfCache(
            len(_self_attention(prefill_cache).layers), first.shape[1], first.shape[3], rows, first.dtype, dev
        )
        self.cache, self.encoder_hidden = self.self_cache, None
        if self.encoder_decoder:
            cross = DynamicCache()
            for i, layer in enumerate(prefill_cache.cross_attention_cache.layers):
                cross.update(layer.keys.clone(), layer.values.clone(), i)  # this utterance's: refilled by `start`
            self.cache = EncoderDecoderCache(self.self_cache, cross)
            self.cache.is_updated.update({i: True for i in range(len(cross.layers))})  # cross keys are reused
            self.encoder_hidden = encoder_hidden.clone()  # only says "cross-attend" to the layers: keys are cached
        self.ids = torch.zeros(1, block, dtype=torch.long, device=dev)
        self.base = torch.arange(block, device=dev)
        self.pos = self.base.clone()
        # a padded prompt (`prompt_padding`): its real rows, and the position id of row i being i + offset
        self.valid = torch.ones(rows, dtype=torch.bool, device=dev)
        self.offset = torch.zeros((), dtype=torch.long, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None
        if graph:
            self._capture(ft, rows - block)

    @property
    def nbytes(self) -> int:
        """Bytes of its key/value buffers (self-attention, and Whisper's cross-attention)."""
        tensors = self.self_cache.keys + self.self_cache.values
        if self.encoder_decoder:
            tensors += [t for layer in self.cache.cross_attention_cache.layers for t in (layer.keys, layer.values)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def serves(self, ft) -> bool:
        """Whether this step still fits `ft`: the same model, every weight where it was when the step was made."""
        return self._model() is ft.model and self.addresses == weight_addresses(ft.model)

    def _inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fixed forward's cache rows written, decoder positions (before a padded prompt's offset) and additive
        mask: the block's rows at its positions, each attending to the rows at or before it."""
        return self.pos, self.pos, self.self_cache.keep_mask(self.pos, self.dtype, self.valid)

    def _forward(self, ft) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify over the fixed inputs (what the graph captures): logits `[B, V]` and taps `[1, B, T*H]`."""
        self.self_cache.write_index, positions, mask = self._inputs()
        if self.encoder_decoder:
            kwargs = dict(
                encoder_outputs=(self.encoder_hidden,),
                decoder_input_ids=self.ids,
                decoder_position_ids=positions[None],
                decoder_attention_mask=mask,
            )
        else:
            kwargs = dict(input_ids=self.ids, position_ids=(positions + self.offset)[None], attention_mask=mask)
        out, feats = ft.tapped_forward(self.layer_ids, **{self.cache_key: self.cache}, use_cache=True, **kwargs)
        return out.logits[0], feats.taps

    def _capture(self, ft, at: int) -> None:
        # warm-up on a side stream, then capture, at the last block's rows: they are written again before any query
        # of a decode reaches them
        torch.add(self.base, at, out=self.pos)
        self.graph, self.out = capture_graph(ft.device, lambda: self._forward(ft))

    def start(self, prefill_cache, encoder_hidden: torch.Tensor | None, padding=None) -> None:
        """Per prompt: its self-attention keys/values (rows 0..L-1; a speech LLM's audio positions included) and,
        for Whisper, the cross-attention keys/values and the encoder output, from the growing cache of the prefill;
        a padded prompt's real rows and position offset (`padding`, a `prompt_padding.PromptPadding`)."""
        self.valid.fill_(True)
        self.offset.fill_(0 if padding is None else padding.offset)
        if padding is not None:
            self.valid[: padding.keep.shape[0]].copy_(padding.keep)
        for i, layer in enumerate(_self_attention(prefill_cache).layers):
            n = layer.keys.shape[2]
            self.self_cache.keys[i][:, :, :n].copy_(layer.keys)
            self.self_cache.values[i][:, :, :n].copy_(layer.values)
        if self.encoder_decoder:
            for fixed, layer in zip(
                self.cache.cross_attention_cache.layers, prefill_cache.cross_attention_cache.layers
            ):
                fixed.keys.copy_(layer.keys)
                fixed.values.copy_(layer.values)
            self.encoder_hidden.copy_(encoder_hidden)

    def verify(self, ft, ids: torch.Tensor, a: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's logits `[B, V]` and taps `[1, B, T*H]` for the block `ids` `[1, B]` at positions `a..a+B-1`;
        fixed tensors that the next call overwrites."""
        self.ids.copy_(ids)
        torch.add(self.base, a, out=self.pos)
        return self._run(ft)

    def _run(self, ft) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward over the fixed inputs as they are now: the graph's replay, or the eager fixed-shape forward."""
        if self.graph is None:
            return self._forward(ft)
        with torch.cuda.device(ft.device):
            self.graph.replay()
        return self.out


def _self_attention(cache):
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def buffer_bytes(prefill_cache, rows: int) -> int:
    """Bytes of a step's key/value buffers for `rows` positions, shaped as the prefill's cache: the fixed
    self-attention rows, and (Whisper) a copy of the cross-attention keys and values."""
    layers = _self_attention(prefill_cache).layers
    keys = layers[0].keys  # [1, kv_heads, L, head_dim]
    total = 2 * len(layers) * keys.shape[1] * keys.shape[3] * rows * keys.element_size()
    if isinstance(prefill_cache, EncoderDecoderCache):
        total += sum(
            t.numel() * t.element_size()
            for layer in prefill_cache.cross_attention_cache.layers
            for t in (layer.keys, layer.values)
        )
    return total


def verify_rows(max_positions: int | None, max_length: int, expansion: int, block: int) -> int:
    """Rows of the fixed buffers: Whisper's decoder positions; a decoder-only target's last block's end (the prompt's
    audio positions included), rounded up to `ROW_ROUNDING` so that prompts of similar length share a step."""
    if max_positions is not None:
        return max_positions
    need = max_length + expansion + block
    return -(-need // ROW_ROUNDING) * ROW_ROUNDING


def verify_step_for(
    ft,
    layer_ids: list[int],
    block: int,
    rows: int,
    prefill_cache,
    step_kwargs: dict,
    graph: bool,
    budget: int | None = None,
    padding=None,
    kind: type[FixedVerifyStep] = FixedVerifyStep,
) -> FixedVerifyStep:
    """The target's :class:`FixedVerifyStep` for these taps, block, rows and (Whisper) encoder frame shape, made once
    and kept beside the target model (a capture costs a few forwards), started for this prompt. `budget`: bytes the
    model's kept steps may hold together, the new one included (the least recently used are dropped to fit).
    `padding`: a padded prompt's `prompt_padding.PromptPadding` (None: unpadded). `kind`: the step's class (a
    subclass verifies a token tree of `block` nodes: `tree_verify.FixedTreeVerifyStep`)."""
    encoder = step_kwargs.get("encoder_outputs")
    encoder_hidden = None if encoder is None else encoder[0]
    store = _STEPS.setdefault(ft.model, {})
    for stale in [k for k in store if k[0] != ft.device]:  # the model moved: those buffers and graphs serve no one
        del store[stale]
    frames = None if encoder_hidden is None else tuple(encoder_hidden.shape)
    key = (ft.device, ft.dtype, tuple(layer_ids), block, rows, frames, graph, kind)
    if budget is not None and key not in store:
        need = buffer_bytes(prefill_cache, rows)
        drop_least_recent(store, lambda s: need + kept_bytes(s) > budget)
    step = reused_step(
        store,
        key,
        MAX_STEPS_PER_TARGET,
        lambda s: s.serves(ft),
        lambda: kind(ft, layer_ids, block, rows, prefill_cache, encoder_hidden, graph),
    )
    step.start(prefill_cache, encoder_hidden, padding)
    return step


def fixed_verify_steps(model) -> dict:
    """The verify steps made for the target `model` so far (keyed by device, dtype, taps, block, rows, frames, mode,
    class)."""
    return _STEPS.get(model, {})


def clear_fixed_verify_steps(model) -> None:
    """Drop `model`'s verify steps and their buffers (and CUDA graphs), and forget a failure under the default."""
    _STEPS.pop(model, None)
    _FAILED.pop(model, None)


def verify_step_blocker(
    ft, block: int, step_kwargs: dict, *, sample: bool, max_positions: int | None, max_length: int | None
) -> str | None:
    """Why the fixed-shape verify cannot run for this decode, or None: it is for greedy decoding, bounded by
    `max_length`, of a Whisper or decoder-only target on one device with SDPA or eager attention (its mask is
    additive); Whisper's blocks must stay within its decoder positions."""
    spread = {p.device for p in ft.model.parameters()} - {ft.device}
    attention = getattr(ft.decoder.config, "_attn_implementation", None)  # the decoder's (a multimodal config's
    # top level may name another implementation than its text config)
    whisper = getattr(ft.model.config, "model_type", None) == "whisper"
    if ft.is_encoder_decoder and not (whisper and step_kwargs.get("encoder_outputs") is not None):
        return "an encoder-decoder target other than Whisper"
    if sample:
        return "sampling (temperature > 0)"
    if spread:
        return f"weights on {sorted(map(str, spread))} besides {ft.device}"
    if attention not in ("sdpa", "eager"):
        return f"attn_implementation {attention!r} (load the target with sdpa or eager attention)"
    if not decoder_attends_fully(ft.decoder.config):  # its explicit causal mask would drop a window's band
        return "a decoder with sliding-window or non-attention layers (its mask is not only causal)"
    if max_length is None:
        return "a decode without a length bound"
    if ft.is_encoder_decoder and (max_positions is None or max_length - 2 + block > max_positions):
        # a cycle's anchor is at most max_length - 2, its block's last row at max_length + block - 3
        return (
            f"a decode whose blocks may pass the decoder's {max_positions} positions (max_length {max_length}; "
            f"pass max_new_tokens so that prompt + max_new_tokens + {block - 2} <= {max_positions})"
        )
    return None


def check_verify_step(
    ft, block: int, step_kwargs: dict, *, sample: bool, max_positions: int | None, max_length: int | None
) -> None:
    """Refuse `verify_cuda_graph=True` before the prefill where the fixed-shape verify cannot run
    (:func:`verify_step_blocker`)."""
    why = verify_step_blocker(ft, block, step_kwargs, sample=sample, max_positions=max_positions, max_length=max_length)
    if why is not None:
        raise ValueError(
            f"verify_cuda_graph=True: the fixed-shape verify is for bounded greedy decoding, not {why}; "
            "pass verify_cuda_graph=None (it then falls back to the growing cache) or False"
        )


def fixed_verify_rows(
    setting: bool | None,
    ft,
    block: int,
    step_kwargs: dict,
    *,
    sample: bool,
    max_positions: int | None,
    max_length: int | None,
    expansion: int,
    nodes: int | None = None,
) -> int | None:
    """Rows of the fixed-shape verify this decode uses, or None for the growing cache. `setting`: True = always
    (refused before the prefill by :func:`check_verify_step` where it cannot run), None = on a GPU where it can run
    and its buffers hold at most `MAX_FIXED_POSITIONS` rows, False = never. `nodes`: rows a verify writes when they
    are not the block's (a token tree's nodes, at rows past its anchor whatever their positions)."""
    if setting is False or (setting is None and ft.device.type != "cuda"):
        return None
    if (
        setting is None
        and verify_step_blocker(
            ft, block, step_kwargs, sample=sample, max_positions=max_positions, max_length=max_length
        )
        is not None
    ):
        return None
    rows = verify_rows(max_positions, max_length, expansion, block)
    if nodes is not None:
        rows = max(rows, verify_rows(None, max_length, expansion, nodes))
    return rows if setting or rows <= MAX_FIXED_POSITIONS else None


def fixed_verify_step(
    setting: bool | None,
    ft,
    layer_ids: list[int],
    block: int,
    prefill_cache,
    step_kwargs: dict,
    *,
    sample: bool,
    max_positions: int | None,
    max_length: int | None,
    expansion: int,
    padding=None,
    nodes: int | None = None,
    kind: type[FixedVerifyStep] = FixedVerifyStep,
) -> FixedVerifyStep | None:
    """The decode's :class:`FixedVerifyStep`, started for this prompt, or None for the growing cache
    (:func:`fixed_verify_rows` decides). Under `setting=None` (the default) the steps kept for a model hold at most
    `AUTO_MAX_BUFFER_BYTES` of key/value buffers together, and a step that fails to build or capture falls back to
    the growing cache with a warning (for this model from then on, until `clear_fixed_verify_steps`; out of memory:
    for this decode only); asked for with True, the error is raised. `padding`: a padded prompt's
    `prompt_padding.PromptPadding` (its mask and positions hold in every verify). `nodes`, `kind`: a token tree's
    verify (`tree_verify.FixedTreeVerifyStep` over `nodes` rows a cycle)."""
    rows = fixed_verify_rows(
        setting,
        ft,
        block,
        step_kwargs,
        sample=sample,
        max_positions=max_positions,
        max_length=max_length,
        expansion=expansion,
        nodes=nodes,
    )
    if rows is None or (
        setting is None and (ft.model in _FAILED or buffer_bytes(prefill_cache, rows) > AUTO_MAX_BUFFER_BYTES)
    ):
        return None
    budget = AUTO_MAX_BUFFER_BYTES if setting is None else None
    return built_or_fallback(
        setting,
        _FAILED,
        ft.model,
        clear_fixed_verify_steps,
        lambda: verify_step_for(
            ft,
            layer_ids,
            nodes or block,
            rows,
            prefill_cache,
            step_kwargs,
            ft.device.type == "cuda",
            budget,
            padding,
            kind,
        ),
        f"the fixed-shape verify of {type(ft.model).__name__}",
        "the growing cache",
        "verify_cuda_graph=False, dflash-eval --verify_cuda_graph off, skips the attempt",
    )


__all__ = [
    "AUTO_MAX_BUFFER_BYTES",
    "FixedSelfCache",
    "FixedVerifyStep",
    "additive_mask",
    "buffer_bytes",
    "check_verify_step",
    "clear_fixed_verify_steps",
    "fixed_verify_rows",
    "fixed_verify_step",
    "verify_step_for",
    "fixed_verify_steps",
    "verify_rows",
    "verify_step_blocker",
]
