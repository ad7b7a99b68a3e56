"""The evaluation's greedy estimates (docs/EVALUATION.md): the draft scored against the target's own greedy next
token, whatever the label source (`greedy_tau_est`), and the decodes those blocks describe walked cycle by cycle
(`greedy_walk_tau_est`: tokens per cycle, as real tau is measured), and for every label source how often the data's
token is the target's greedy one (`target_agreement`: below 0.9 the estimates are taken in contexts the target does
not write). `DFlashObjective.loss` sets them on its `BlockLoss` when the draft is in eval mode; the loss and the other
statistics do not change."""

from __future__ import annotations

import torch

from dflash_hf.objective.blocks import Blocks, label_positions
from dflash_hf.objective.labels import LabelSource
from dflash_hf.objective.labels.target_argmax import target_argmax_labels
from dflash_hf.objective.losses import BlockLoss, DFlash2BlockLoss
from dflash_hf.objective.losses.metrics import acceptance_lengths, decode_walk


def greedy_slot_correct(predictions: torch.Tensor, greedy_ids: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """`[b, N, B-1]` bool: the draft's argmax (`predictions` `[M]`, one per valid slot in `Blocks.flat_valid_index`
    order) equals `greedy_ids` `[b, S]` (the target's greedy next token, `target_argmax_labels`) at the slot's
    position `a + k`; False on invalid slots."""
    index = blocks.flat_valid_index().to(predictions.device, non_blocking=True)
    s = greedy_ids.shape[1]
    k = torch.arange(1, blocks.block_size, device=greedy_ids.device)
    pos = (blocks.anchors.clamp(min=0)[..., None] + k).clamp(max=s - 1)  # [b, N, B-1]
    labels = torch.gather(greedy_ids, 1, pos.flatten(1)).flatten().index_select(0, index)
    hits = (predictions == labels).to(torch.bool)
    flat = torch.zeros(blocks.valid.numel(), dtype=torch.bool, device=predictions.device)
    return flat.index_copy(0, index, hits).view(blocks.valid.shape)


def data_agreement(input_ids: torch.Tensor, label_ids: torch.Tensor, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """`(agreeing, relabelled)`: of the positions a target label source relabels (`label_positions` of the plan's
    CPU masks), how many labels equal the data token. Low agreement means the data is not what the target writes
    (docs/GENERATED_LABELS.md). Counts stay on their devices (no synchronization)."""
    need = label_positions(plan.loss_mask, plan.doc_ids)
    agree = (label_ids == input_ids) & need.to(input_ids.device, non_blocking=True)
    return agree.sum(), need.sum()


def score_greedy(out: BlockLoss, plan, blocks: Blocks, source: LabelSource, features: tuple) -> None:
    """Set `greedy_correct` and `greedy_walk` of `out` and, for DFlash2, of its selector (the rule its decodes propose
    by). A `source` whose labels are the target's greedy tokens (`target_argmax`) gave the greedy score as `correct`;
    for the others `target_argmax_labels` computes the greedy tokens from `features` = `(target, final_hidden,
    input_ids)` (row coordinates), `--target_argmax_chunk_size` positions at a time, and `data_agreement` counts how
    often they are the data's (a relabelling source counted it already). `plan`: the micro-batch's CPU `BlockPlan`
    (anchors, loss mask and documents: the label positions, and the walk, on the host)."""
    greedy_ids = None
    if not source.greedy:
        target, final_hidden, input_ids = features
        chunk = source.target_argmax_chunk_size
        greedy_ids = target_argmax_labels(target, final_hidden, input_ids, plan.loss_mask, plan.doc_ids, chunk)
        if out.data_agreement is None:
            out.data_agreement = data_agreement(input_ids, greedy_ids, plan)
    terms = [out, out.selector] if isinstance(out, DFlash2BlockLoss) else [out]
    for term in terms:
        if greedy_ids is None:
            term.greedy_correct = term.correct
        else:
            term.greedy_correct = greedy_slot_correct(term.predictions, greedy_ids, blocks)
        lengths = acceptance_lengths(term.greedy_correct)  # one read of the device per term: evaluation only
        term.greedy_walk = decode_walk(plan.anchors, lengths, plan.loss_mask, plan.doc_ids)


__all__ = ["data_agreement", "greedy_slot_correct", "score_greedy"]
