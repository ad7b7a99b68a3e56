"""DFlash2's losses (docs/ARCHITECTURE.md, "DFlash2"): the base weighted CE of the dense draft logits and the
path selector's k-way CE over the top-k candidates of the same logits, each with its own denominator. The
selector's denominator depends on the draft's logits, so that term declares `denominator_after_forward`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from dflash_hf.objective.blocks import Blocks
from dflash_hf.objective.labels import SoftLabels
from dflash_hf.objective.losses.ce import DecayedCE
from dflash_hf.objective.losses.common import BlockLoss, SlotLoss, ValidSlots, map_chunks, slot_cross_entropy


def _chunk_dflash2(
    hidden: torch.Tensor,  # [m, H]
    labels: torch.Tensor,  # [m]
    predecessors: torch.Tensor,  # [m] teacher-forced previous token
    *soft: torch.Tensor,  # soft label ids and probabilities [m, k] (label_source=target_distribution)
    weight: torch.Tensor,  # [V, H]
    selector: nn.Module,  # DFlash2CandidateSelector
):
    """Base CE and argmax, plus the selector CE over the top-k candidates of the same dense logits."""
    logits = F.linear(hidden, weight).float()  # [m, V]
    ce = slot_cross_entropy(logits, labels, *soft)  # [m]
    unary, candidates = logits.topk(selector.top_k, dim=-1)  # [m, k]
    scores = selector(hidden, unary, candidates, predecessors)  # [m, k]
    is_label = candidates == labels[:, None]  # [m, k], at most one True per row
    hit = is_label.any(-1)  # [m] true token among the candidates
    sel_ce = torch.where(hit, torch.logsumexp(scores, -1) - (scores * is_label).sum(-1), 0.0)
    sel_pred = candidates.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1)
    return ce, logits.argmax(-1), sel_ce, sel_pred, hit


@dataclass
class DFlash2BlockLoss(BlockLoss):
    """Base sums (the inherited fields) plus the selector's, each with its own denominator."""

    selector: BlockLoss | None = None  # Σ w·selector CE; weight_sum = Σ w over slots whose label is a candidate;
    # correct = selector path's argmax (teacher-forced predecessor) equals the label
    candidate_hits: torch.Tensor | None = None  # [b, N, B-1] bool: label among the top-k candidates (valid slots)


def dflash2_block_loss(
    hidden: torch.Tensor,  # [b, N, B, H] final-normed draft hidden of every slot
    blocks: Blocks,
    lm_head_weight: torch.Tensor,  # [V, H] frozen
    selector: nn.Module,  # the draft's DFlash2CandidateSelector
    chunk_size: int,  # `ce_chunk_size`
    loss: SlotLoss | None = None,
    soft: SoftLabels | None = None,
) -> DFlash2BlockLoss:
    """DFlash2 losses, chunk-wise (one chunk of `[m, V]` logits alive, recomputed in backward):
    base = weighted CE of the dense logits (exactly `block_loss`, `loss` default the decayed CE); selector = k-way
    CE over `S(a, b) = U(b) + <A[a] * H(h), B[b]>` for the top-k candidates b with the teacher-forced predecessor
    a, only on slots whose (hard) label is a candidate, with the same slot weights."""
    if blocks.predecessors is None:
        raise ValueError("DFlash2 loss needs Blocks.predecessors; build the blocks with blocks.build_blocks")
    loss = loss or DecayedCE()
    valid = ValidSlots.of(hidden, blocks, soft)
    labels, scatter = valid.labels, valid.scatter
    ce, pred, sel_ce, sel_pred, hit = map_chunks(
        partial(_chunk_dflash2, weight=lm_head_weight, selector=selector),
        valid.rows(blocks.predecessors.flatten().index_select(0, valid.index)),
        chunk_size,
    )
    w = loss.weights(valid, ce.detach())
    zero = hidden.sum() * 0.0  # keeps the graph connected when no slot is valid
    return DFlash2BlockLoss(
        loss_sum=(w * ce).sum() + zero,
        weight_sum=loss.denominator(valid, blocks, w),
        correct=scatter(pred == labels),
        blocks=blocks,
        denominator_after_forward=loss.denominator_after_forward,
        predictions=pred,
        selector=BlockLoss(
            loss_sum=(w * sel_ce).sum() + zero,
            weight_sum=(w * hit).sum().detach(),
            correct=scatter(sel_pred == labels),
            blocks=blocks,
            denominator_after_forward=True,
            predictions=sel_pred,
        ),
        candidate_hits=scatter(hit),
    )
