"""What every loss shares: the valid slots of a micro-batch as flat rows, chunked projection to the vocabulary,
per-slot cross-entropy against hard or soft labels, and the per-micro-batch sums (`BlockLoss`).

Losses are *sums* (`Σ w·ℓ`) with their denominators, so the objective normalizes over the global batch (every
micro-batch and rank) and the result does not depend on how a batch is split (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_hf.objective.blocks import Blocks
from dflash_hf.objective.labels import SoftLabels


def map_chunks(fn: Callable[..., tuple[torch.Tensor, ...]], rows: Sequence[torch.Tensor], chunk_size: int):
    """`fn` over row chunks of `rows` (each `[M, ...]`), outputs concatenated. A chunk whose first input
    needs grad is recomputed in backward (activation checkpointing), so peak memory holds one chunk of
    logits. `M == 0` runs `fn` once on the empty rows (outputs keep their dtypes, the graph stays connected)."""
    outs = []
    for start in range(0, max(rows[0].shape[0], 1), chunk_size):
        part = [r[start : start + chunk_size] for r in rows]
        if torch.is_grad_enabled() and part[0].requires_grad:
            outs.append(checkpoint(fn, *part, use_reentrant=False))
        else:
            outs.append(fn(*part))
    return tuple(torch.cat(o) for o in zip(*outs))


@dataclass
class BlockLoss:
    """Sums over one micro-batch. `loss_sum` is differentiable; the rest are detached statistics.

    `denominator_after_forward`: the denominator depends on the draft's own outputs (the DFlash2 selector's, or
    a registered loss that declares it), so it cannot be planned before the step; the objective normalizes such
    a term per micro-batch (`DFlashObjective.normalize`)."""

    loss_sum: torch.Tensor  # Σ w·ℓ
    weight_sum: torch.Tensor  # the denominator of loss_sum in this micro-batch (Σ w for the decayed CE)
    correct: torch.Tensor  # [b, N, B-1] bool, argmax == label on valid slots
    blocks: Blocks
    denominator_after_forward: bool = False
    # (agreeing, relabelled) label positions where a target label source's label equals the data token
    data_agreement: tuple[torch.Tensor, torch.Tensor] | None = None
    predictions: torch.Tensor | None = None  # [M] the draft's argmax on the valid slots (`Blocks.flat_valid_index`)
    # [b, N, B-1] bool: the draft's argmax equals the target's greedy next token (evaluation: `greedy_tau_est`)
    greedy_correct: torch.Tensor | None = None
    # (tokens, cycles) of greedy decodes walked over the blocks' greedy acceptance (`greedy_walk`, evaluation)
    greedy_walk: tuple[int, int] | None = None


@dataclass
class ValidSlots:
    """The valid slots of a micro-batch as flat rows, selected by index (`Blocks.flat_valid_index`): with the
    indices planned on the CPU, neither the selection nor the scatter back synchronizes with the device."""

    index: torch.Tensor  # [M] flat indices into [b, N, B-1]
    hidden: torch.Tensor  # [M, H] draft hidden of those slots
    labels: torch.Tensor  # [M]
    weights: torch.Tensor  # [M] planned slot weights (decay * validity)
    shape: torch.Size  # [b, N, B-1]
    soft: SoftLabels | None = None  # [M, k] soft labels of those slots (label_source=target_distribution)

    @classmethod
    def of(cls, hidden: torch.Tensor, blocks: Blocks, soft: SoftLabels | None = None) -> ValidSlots:
        """`hidden`: `[b, N, B, H]`; slot k >= 1 of block q is row `q*B + k` of the flattened hidden. `soft`:
        per-position soft labels `[b, S, k]`, gathered at each valid slot's position `a + k`."""
        index = blocks.flat_valid_index().to(hidden.device, non_blocking=True)
        per_block = blocks.block_size - 1
        rows = index + index // per_block + 1
        if soft is not None:
            block = index // per_block  # flat [b * N] block of each slot
            row = block // blocks.anchors.shape[1]
            pos = blocks.anchors.flatten().index_select(0, block) + index % per_block + 1
            soft = SoftLabels(ids=soft.ids[row, pos], probs=soft.probs[row, pos])
        return cls(
            index=index,
            hidden=hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows),
            labels=blocks.labels.flatten().index_select(0, index),
            weights=blocks.weights.flatten().index_select(0, index),
            shape=blocks.valid.shape,
            soft=soft,
        )

    def rows(self, *extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Row inputs of a chunk function: hidden, labels, `extra`, then the soft ids and probabilities if any."""
        soft = (self.soft.ids, self.soft.probs) if self.soft is not None else ()
        return (self.hidden, self.labels, *extra, *soft)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """`[M]` values back to `[b, N, B-1]`, zero (False) on invalid slots."""
        out = values.new_zeros(self.shape.numel())
        return out.index_copy(0, self.index, values).view(self.shape)


def slot_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *soft: torch.Tensor) -> torch.Tensor:
    """Per-row CE of float32 logits `[m, V]`: against `labels`, or with soft labels `(ids [m, k], probs [m, k])`
    (probabilities summing to 1) `-Σ_v p(v) log softmax(logits)(v) = logsumexp - Σ_v p(v) logits(v)`."""
    if not soft:
        return F.cross_entropy(logits, labels, reduction="none")
    ids, probs = soft
    return torch.logsumexp(logits, dim=-1) - (probs * logits.gather(1, ids)).sum(-1)


def chunk_ce(hidden: torch.Tensor, labels: torch.Tensor, *soft: torch.Tensor, weight: torch.Tensor):
    """CE and argmax of one chunk of dense logits `hidden @ weightᵀ` (`[m, V]`, float32 math)."""
    logits = F.linear(hidden, weight).float()
    return slot_cross_entropy(logits, labels, *soft), logits.argmax(-1)


class SlotLoss:
    """A `--loss_type`: how the per-slot cross-entropy of the valid slots is weighted and what it is divided by.

    `weights_before_forward`: the weights are known before the draft runs (the fused lm_head + CE kernel takes
    them as inputs); otherwise `weights` derives them from the detached per-slot CE. `denominator_after_forward`:
    the denominator is only known after the forward (then normalized per micro-batch, as the DFlash2 selector);
    otherwise `planned_denominator` gives it at planning time, for the global-batch normalization."""

    name: ClassVar[str]
    weights_before_forward: ClassVar[bool] = True
    denominator_after_forward: ClassVar[bool] = False

    def planned_denominator(self, valid: torch.Tensor, gamma: float) -> torch.Tensor:
        """The micro-batch's denominator from `valid = slot_validity(...)` `[b, N, B-1]` (before any forward)."""
        raise NotImplementedError

    def denominator(self, slots: ValidSlots, blocks: Blocks, weights: torch.Tensor) -> torch.Tensor:
        """The same denominator from the micro-batch's device tensors (detached)."""
        raise NotImplementedError

    def weights(self, slots: ValidSlots, ce: torch.Tensor) -> torch.Tensor:
        """Weight `[M]` of each valid slot; `ce` is its detached cross-entropy `[M]`."""
        return slots.weights
