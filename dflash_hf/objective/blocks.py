"""Anchors, block layout, attention masks and positions (docs/ARCHITECTURE.md), for padded and packed rows.

Coordinates: every tensor here is in *row* coordinates after leading padding was moved to the end
(`move_leading_padding`), so real tokens of a row occupy `[0, len)` and padding never precedes them.

A row's documents are described by `doc_ids[b, S]` (document index, -1 on padding) and
`positions[b, S]` (RoPE position of each token, restarting at 0 per document).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:  # pragma: no cover
    BlockMask = None


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------
def leading_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """Number of leading padding positions per row: `[b]`."""
    real = attention_mask.bool()
    first = torch.where(real.any(-1), real.int().argmax(-1), torch.zeros_like(real[:, 0], dtype=torch.long))
    return first.long()


def move_leading_padding(x: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Roll each row of `x` (`[b, S, ...]`) left by `shifts[b]`: leading padding goes to the end."""
    if not bool(shifts.any()):  # pass CPU shifts (as `BlockPlan` keeps them) to avoid a device sync here
        return x
    b, s = x.shape[:2]
    shifts = shifts.to(x.device, non_blocking=True)
    idx = (torch.arange(s, device=x.device)[None] + shifts[:, None]) % s  # [b, S]
    idx = idx.view(b, s, *([1] * (x.dim() - 2))).expand_as(x)
    return torch.gather(x, 1, idx)


def doc_ids_from(attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Document index per token (`-1` on padding). Packed rows start a new document wherever
    `position_ids` restarts at 0; a padded row is one document."""
    real = attention_mask.bool()
    if position_ids is None:
        return torch.where(real, 0, -1)
    starts = (position_ids == 0) & real
    docs = torch.cumsum(starts.long(), dim=-1) - 1
    return torch.where(real, docs, -1)


def row_positions(attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE positions of the draft context: `position_ids` for packed rows, else 0..len-1 per row
    (rows are already left-aligned)."""
    if position_ids is not None:
        return position_ids.long()
    s = attention_mask.shape[-1]
    return torch.arange(s, device=attention_mask.device)[None].expand_as(attention_mask).long()


def label_positions(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """`[b, S]` bool: positions t that get a label from the target's state at t-1 (`target_argmax`,
    `target_distribution`): t is supervised and t-1 is a real token of the same document."""
    need = torch.zeros_like(loss_mask, dtype=torch.bool)
    need[:, 1:] = loss_mask[:, 1:].bool() & (doc_ids[:, 1:] >= 0) & (doc_ids[:, :-1] == doc_ids[:, 1:])
    return need


# --------------------------------------------------------------------------------------------
# Anchors
# --------------------------------------------------------------------------------------------
def valid_anchor_mask(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """`[b, S]` bool: a is supervised and a+1 is a supervised token of the same document."""
    lm = loss_mask.bool() & (doc_ids >= 0)
    ok = torch.zeros_like(lm)
    ok[:, :-1] = lm[:, :-1] & lm[:, 1:] & (doc_ids[:, :-1] == doc_ids[:, 1:])
    return ok


def sample_anchors(
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
    per_document: bool = False,
    budget: int | None = None,
    pad_multiple: int = 1,
) -> torch.Tensor:
    """Draw anchors uniformly without replacement and sort them.

    Per row (or per document when `per_document`, as for packed rows) take
    `min(num_anchors, #valid)`; `budget` caps the total per row (dropping uniformly at random).
    Returns `[b, N]` with `-1` for unused entries; N is the largest count, rounded up to
    `pad_multiple` (fewer distinct shapes for compiled kernels).
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    device = loss_mask.device
    loss_mask, doc_ids = loss_mask.cpu(), doc_ids.cpu()
    valid = valid_anchor_mask(loss_mask, doc_ids)
    if not per_document and budget is None:
        return _sample_row_anchors(valid, num_anchors, generator, pad_multiple).to(device)
    rows: list[torch.Tensor] = []
    for r in range(valid.shape[0]):
        cand = valid[r].nonzero().flatten()
        groups = [cand[doc_ids[r, cand] == d] for d in doc_ids[r, cand].unique()] if per_document else [cand]
        picked = []
        for g in groups:
            if len(g) == 0:
                continue
            k = min(num_anchors, len(g))
            picked.append(g[torch.randperm(len(g), generator=generator)[:k]])
        chosen = torch.cat(picked) if picked else cand[:0]
        if budget is not None and len(chosen) > budget:
            chosen = chosen[torch.randperm(len(chosen), generator=generator)[:budget]]
        rows.append(chosen.sort().values)
    n = max([len(r) for r in rows] + [1])
    n = int(math.ceil(n / pad_multiple) * pad_multiple)
    out = torch.full((valid.shape[0], n), -1, dtype=torch.long)
    for r, chosen in enumerate(rows):
        out[r, : len(chosen)] = chosen
    return out.to(device)


def _sample_row_anchors(
    valid: torch.Tensor, num_anchors: int, generator: torch.Generator | None, pad_multiple: int
) -> torch.Tensor:
    """`sample_anchors` per row, for all rows at once: the `min(num_anchors, #valid)` valid positions with the
    smallest i.i.d. uniform keys (a uniform draw without replacement), sorted; `-1` pads."""
    keys = torch.rand(valid.shape, generator=generator).masked_fill_(~valid, 2.0)  # [b, S]; invalid sort last
    count = valid.sum(1).clamp(max=num_anchors)  # [b]
    n = int(math.ceil(max(int(count.max()) if count.numel() else 0, 1) / pad_multiple) * pad_multiple)
    n_take = min(n, valid.shape[1])
    picked = keys.argsort(dim=1, stable=True)[:, :n_take]  # [b, n_take] positions, smallest keys first
    used = torch.arange(n_take)[None, :] < count[:, None]
    picked = torch.where(used, picked, valid.shape[1]).sort(dim=1).values  # chosen positions ascending, unused last
    out = torch.full((valid.shape[0], n), -1, dtype=torch.long)
    out[:, :n_take] = torch.where(used, picked, -1)
    return out


def slot_decay(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """`w_k = exp(-(k-1)/gamma)` for slots k = 1..B-1: `[B-1]`."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


# --------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------
@dataclass
class Blocks:
    """One block per anchor. Shapes: `[b, N, B]` for ids/positions, `[b, N, B-1]` for labels/weights."""

    anchors: torch.Tensor  # [b, N], -1 = unused
    ids: torch.Tensor  # [b, N, B]: anchor token then mask tokens
    positions: torch.Tensor  # [b, N, B]: pos[a] + k
    labels: torch.Tensor  # [b, N, B-1]: token at a+k (0 where invalid)
    valid: torch.Tensor  # [b, N, B-1] bool: a+k inside the row, same document, supervised
    weights: torch.Tensor  # [b, N, B-1]: decay * valid
    # [b, N, B-1]: teacher-forced token before each slot (anchor token for slot 1, else the label at a+k-1;
    # 0 where invalid), the predecessor of the DFlash2 path selector
    predecessors: torch.Tensor | None = None
    # [M] flat indices of the valid slots in `valid.flatten()`, when known in advance (the trainer computes
    # them on the CPU at planning time, so the loss needs no device sync to find them)
    valid_index: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.ids.shape[-1]

    def flat_valid_index(self) -> torch.Tensor:
        """`valid_index`, or computed from `valid` (a device sync on accelerators)."""
        if self.valid_index is not None:
            return self.valid_index
        return self.valid.flatten().nonzero().squeeze(1)

    @property
    def anchor_valid(self) -> torch.Tensor:
        return self.anchors >= 0


def build_blocks(
    input_ids: torch.Tensor,  # [b, S] draft-side ids (anchor tokens are read here)
    labels: torch.Tensor,  # [b, S] label per position (ground truth or target argmax)
    loss_mask: torch.Tensor,  # [b, S]
    doc_ids: torch.Tensor,  # [b, S]
    positions: torch.Tensor,  # [b, S]
    anchors: torch.Tensor,  # [b, N]
    block_size: int,
    mask_token_id: int,
    gamma: float,
    valid_index: torch.Tensor | None = None,  # [M] flat valid-slot indices, if precomputed (`Blocks.valid_index`)
    valid: torch.Tensor | None = None,  # [b, N, B-1] `slot_validity(...)`, if already computed (the plan has it)
) -> Blocks:
    s = input_ids.shape[1]
    dev = input_ids.device
    anchors = anchors.to(dev, non_blocking=True)
    a = anchors.clamp(min=0)  # [b, N]
    k = torch.arange(block_size, device=dev)
    tgt_c = (a[..., None] + k).clamp(max=s - 1)  # [b, N, B] absolute index of each slot (clamped)

    def take(x: torch.Tensor) -> torch.Tensor:
        return torch.gather(x, 1, tgt_c.flatten(1)).view_as(tgt_c)

    ids = torch.full_like(tgt_c, mask_token_id)
    ids[..., 0] = torch.gather(input_ids, 1, a)
    block_pos = torch.gather(positions, 1, a)[..., None] + k
    if valid is None:
        valid = slot_validity(loss_mask, doc_ids, anchors, block_size)
    valid = valid.to(dev, non_blocking=True)
    lab = torch.where(valid, take(labels)[..., 1:], 0)
    prev = torch.where(valid, torch.cat([ids[..., :1], take(labels)[..., 1:-1]], dim=-1), 0)
    weights = slot_decay(block_size, gamma, dev) * valid
    return Blocks(
        anchors=anchors,
        ids=ids,
        positions=block_pos,
        labels=lab,
        valid=valid,
        weights=weights,
        predecessors=prev,
        valid_index=valid_index,
    )


def slot_validity(loss_mask: torch.Tensor, doc_ids: torch.Tensor, anchors: torch.Tensor, block_size: int):
    """`[b, N, B-1]` bool: slot k of the block at anchor a is supervised — `a+k` lies inside the row, in the
    anchor's document, and is in the loss mask (slots 1..B-1; unused anchors have none)."""
    s = loss_mask.shape[1]
    a = anchors.clamp(min=0)
    tgt = a[..., None] + torch.arange(1, block_size, device=a.device)
    inside = tgt < s
    tgt_c = tgt.clamp(max=s - 1).flatten(1)
    same = torch.gather(doc_ids, 1, tgt_c).view_as(tgt) == torch.gather(doc_ids, 1, a)[..., None]
    sup = torch.gather(loss_mask.bool(), 1, tgt_c).view_as(tgt)
    return (anchors >= 0)[..., None] & inside & same & sup


def loss_weight_sum(valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """Sum of slot weights a batch contributes (the global-normalization denominator), computable before any
    forward from `valid = slot_validity(...)`: it depends only on anchors, documents and the loss mask."""
    return (slot_decay(valid.shape[-1] + 1, gamma, valid.device) * valid).sum()


# --------------------------------------------------------------------------------------------
# Attention masks: queries are the N*B block slots, keys are [context (S) ; block slots (N*B)]
# --------------------------------------------------------------------------------------------
def _anchor_docs(anchors: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    # Document of each anchor; -2 for unused anchors (matches no context token, padding is -1).
    return torch.where(anchors >= 0, torch.gather(doc_ids, 1, anchors.clamp(min=0)), -2)


def dense_block_mask(anchors: torch.Tensor, doc_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Boolean SDPA mask `[b, 1, N*B, S + N*B]` (True = may attend).

    Slot queries see context keys `j < a` of the anchor's document and every slot of their own block.
    """
    b, n = anchors.shape
    s = doc_ids.shape[1]
    j = torch.arange(s, device=doc_ids.device)
    ctx = (j[None, None] < anchors[..., None]) & (doc_ids[:, None, :] == _anchor_docs(anchors, doc_ids)[..., None])
    ctx = ctx.repeat_interleave(block_size, dim=1)  # [b, N*B, S]
    blk_id = torch.arange(n * block_size, device=doc_ids.device) // block_size
    own = (blk_id[:, None] == blk_id[None, :]).expand(b, -1, -1)  # [b, N*B, N*B]
    return torch.cat([ctx, own], dim=-1)[:, None]


@dataclass
class FlexLayout:
    """Tile layout of a FlexAttention `BlockMask`, int32: kv-major (`[b, 1, q tiles]` counts, `[b, 1, q tiles,
    kv tiles]` indices: the kv tiles each q tile visits partially, `mask_mod` applied, and fully) and the same
    transposed, q-major, for the backward pass."""

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    full_q_num_blocks: torch.Tensor
    full_q_indices: torch.Tensor
    tile: int

    def to(self, device, non_blocking: bool = False) -> FlexLayout:
        moved = {k: v.to(device, non_blocking=non_blocking) if torch.is_tensor(v) else v for k, v in vars(self).items()}
        return FlexLayout(**moved)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean `[..., kv tiles]` -> (count, indices of the set tiles first in ascending order, then the rest)."""
    tiles = tiles.int()
    order = torch.argsort(tiles, dim=-1, descending=True, stable=True)
    return tiles.sum(-1).int().contiguous(), order.int().contiguous()


def flex_block_layout(anchors: torch.Tensor, doc_ids: torch.Tensor, block_size: int, tile: int = 128) -> FlexLayout:
    """The `BlockMask` tile layout of `dense_block_mask`'s semantics, computed on the host from the anchors.

    Every query of the block at anchor `a` sees the context interval `[start of a's document, a)` (documents
    are contiguous spans of a row) and its own block's `B` slots, so the visible pairs of each (q tile, kv tile)
    follow from interval overlaps: no `[Q, KV]` mask is evaluated and nothing runs on the device. A tile is full
    when all `tile x tile` pairs are visible (pairs past the sequence ends count as invisible) and partial when
    some are: the same layout `create_block_mask(mask_mod)` derives from the dense mask."""
    anchors, doc_ids = anchors.cpu(), doc_ids.cpu()
    b, n = anchors.shape
    s = doc_ids.shape[1]
    q_len, kv_len = n * block_size, s + n * block_size
    nq, nkv = -(-q_len // tile), -(-kv_len // tile)
    real = doc_ids >= 0
    if bool((real[:, 1:] & ~real[:, :-1]).any()) or bool((doc_ids[:, 1:] < doc_ids[:, :-1])[real[:, 1:]].any()):
        raise ValueError("flex_block_layout needs contiguous documents with padding at the end of each row")
    pos = torch.arange(s).expand(b, s)
    new_doc = torch.ones_like(real)
    new_doc[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    doc_start = torch.where(new_doc, pos, 0).cummax(dim=1).values  # [b, S] first position of each token's doc
    has = anchors >= 0
    a = anchors.clamp(min=0)
    lo = torch.where(has, torch.gather(doc_start, 1, a), 0)[..., None]  # [b, N, 1] visible context [lo, hi)
    hi = torch.where(has, a, 0)[..., None]
    t0 = torch.arange(nkv) * tile  # kv tile t covers [t0, t1)
    t1 = (t0 + tile).clamp(max=kv_len)
    ctx = (torch.minimum(hi, t1.clamp(max=s)) - torch.maximum(lo, t0)).clamp(min=0)  # [b, N, kv tiles]
    own0 = (s + torch.arange(n) * block_size)[:, None]  # [N, 1] the block's own slots [own0, own0 + B)
    own = (torch.minimum(own0 + block_size, t1) - torch.maximum(own0, t0)).clamp(min=0)  # [N, kv tiles]
    per_block = ctx + own  # [b, N, kv tiles] visible keys of each query of the block
    if tile % block_size == 0:  # blocks never straddle q tiles: sum whole blocks
        per_block = torch.nn.functional.pad(per_block, (0, 0, 0, nq * (tile // block_size) - n))
        count = per_block.view(b, nq, tile // block_size, nkv).sum(2) * block_size
    else:
        per_query = per_block.repeat_interleave(block_size, dim=1)  # [b, Q, kv tiles]
        per_query = torch.nn.functional.pad(per_query, (0, 0, 0, nq * tile - q_len))
        count = per_query.view(b, nq, tile, nkv).sum(2)
    count = count[:, None]  # [b, 1, q tiles, kv tiles] visible (query, key) pairs
    full = count == tile * tile
    partial = (count > 0) & ~full
    return FlexLayout(
        *_ordered(partial),
        *_ordered(full),
        *_ordered(partial.transpose(-1, -2)),
        *_ordered(full.transpose(-1, -2)),
        tile=tile,
    )


def flex_block_mask(anchors: torch.Tensor, doc_ids: torch.Tensor, block_size: int, layout: FlexLayout | None = None):
    """FlexAttention `BlockMask` with exactly the semantics of `dense_block_mask`. The tile layout comes from
    `flex_block_layout` (pass the one planned on the host to keep the device from waiting); `mask_mod` decides
    the pairs inside partial tiles."""
    if BlockMask is None:
        raise RuntimeError("FlexAttention needs torch >= 2.6; use attention_backend='sdpa'")
    b, n = anchors.shape
    s = doc_ids.shape[1]
    layout = layout if layout is not None else flex_block_layout(anchors, doc_ids, block_size)
    layout = layout.to(anchors.device, non_blocking=True)
    adoc = _anchor_docs(anchors, doc_ids)

    def mask_mod(bi, hi, q_idx, kv_idx):
        blk = q_idx // block_size
        is_ctx = kv_idx < s
        kv_c = torch.clamp(kv_idx, max=s - 1)
        ctx_ok = is_ctx & (kv_idx < anchors[bi, blk]) & (doc_ids[bi, kv_c] == adoc[bi, blk])
        own = (~is_ctx) & ((kv_idx - s) // block_size == blk)
        return ctx_ok | own

    # Both orientations come from the host (`from_kv_blocks` would transpose on the device every micro-batch).
    return BlockMask(
        seq_lengths=(n * block_size, s + n * block_size),
        kv_num_blocks=layout.kv_num_blocks,
        kv_indices=layout.kv_indices,
        full_kv_num_blocks=layout.full_kv_num_blocks,
        full_kv_indices=layout.full_kv_indices,
        q_num_blocks=layout.q_num_blocks,
        q_indices=layout.q_indices,
        full_q_num_blocks=layout.full_q_num_blocks,
        full_q_indices=layout.full_q_indices,
        BLOCK_SIZE=(layout.tile, layout.tile),
        mask_mod=mask_mod,
    )


def attention_mask_for(
    backend: str, anchors: torch.Tensor, doc_ids: torch.Tensor, block_size: int, layout: FlexLayout | None = None
):
    """The attention mask of the backend: a flex `BlockMask` (with `layout` if planned) or a dense boolean mask."""
    if backend == "flex":
        return flex_block_mask(anchors, doc_ids, block_size, layout)
    if backend == "sdpa":
        return dense_block_mask(anchors, doc_ids, block_size)
    raise ValueError(f"attention_backend must be 'flex' or 'sdpa', got {backend!r}")
