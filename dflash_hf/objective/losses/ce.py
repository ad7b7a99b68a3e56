"""`--loss_type ce` (the default): the decayed block cross-entropy of the DFlash recipe.

Slot k = 1..B-1 of a block has the planned weight `w_k = exp(-(k-1)/gamma)` times its validity
(`blocks.slot_decay`); the loss is `Σ w·CE / Σ w` over the global batch, the denominator known at planning time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from dflash_hf.objective.blocks import Blocks, loss_weight_sum
from dflash_hf.objective.labels import SoftLabels
from dflash_hf.objective.losses.common import BlockLoss, SlotLoss, ValidSlots, chunk_ce, map_chunks
from dflash_hf.ops.fused_ce import fused_lm_head_ce


@dataclass
class DecayedCE(SlotLoss):
    name = "ce"

    def planned_denominator(self, valid: torch.Tensor, gamma: float) -> torch.Tensor:
        return loss_weight_sum(valid, gamma)

    def denominator(self, slots: ValidSlots, blocks: Blocks, weights: torch.Tensor) -> torch.Tensor:
        return weights.sum().detach()


def block_loss(
    hidden: torch.Tensor,  # [b, N, B, H] final-normed draft hidden of every slot
    blocks: Blocks,
    lm_head_weight: torch.Tensor,
    chunk_size: int,  # `ce_chunk_size`
    fused: bool = True,
    loss: SlotLoss | None = None,
    soft: SoftLabels | None = None,
    fp8: bool = False,
) -> BlockLoss:
    """Weighted CE over slots 1..B-1 of every block (`loss`, default the decayed CE); only valid slots are projected
    to the vocabulary. `fused`: `fused_lm_head_ce` (hard labels, weights known before the forward); else dense
    per-chunk logits, recomputed in backward (`map_chunks`). `soft`: per-position soft labels `[b, S, k]`. `fp8`: the
    fused kernel's input-gradient matmul in FP8 (`float8_lm_head`)."""
    loss = loss or DecayedCE()
    valid = ValidSlots.of(hidden, blocks, soft)
    if fused:
        if soft is not None or not loss.weights_before_forward:
            raise ValueError(
                f"the fused lm_head + CE needs hard labels and planned weights (loss_type={loss.name}, "
                f"soft labels: {soft is not None}); set use_fused_linear_ce=false"
            )
        weights = valid.weights
        ce_sum, pred = fused_lm_head_ce(valid.hidden, lm_head_weight, valid.labels, weights, chunk_size, fp8)
    else:
        if fp8:
            raise ValueError(
                "float8_lm_head=true runs in the fused lm_head + CE: set use_fused_linear_ce=true or "
                "float8_lm_head=false"
            )
        ce, pred = map_chunks(partial(chunk_ce, weight=lm_head_weight), valid.rows(), chunk_size)
        weights = loss.weights(valid, ce.detach())
        ce_sum = (weights * ce).sum()
    # `hidden.sum() * 0` keeps the graph connected when no slot is valid (a differentiable zero).
    loss_sum = ce_sum + hidden.sum() * 0.0
    correct = valid.scatter(pred == valid.labels)
    return BlockLoss(
        loss_sum=loss_sum,
        weight_sum=loss.denominator(valid, blocks, weights),
        correct=correct,
        blocks=blocks,
        denominator_after_forward=loss.denominator_after_forward,
        predictions=pred,
    )
