"""`--label_source target_distribution`: soft labels, the frozen target's top-k next-token distribution.

At the positions `target_argmax` labels (supervised t whose predecessor t-1 is a real token of the same document;
`blocks.label_positions`) and with the same chunking (`--target_argmax_chunk_size` positions projected at a time),
the target's logits at t-1 (the ids `generate` suppresses left out, `FrozenTarget.label_logits`) give the top
`--label_top_k` tokens and their probabilities renormalized over those k (the softmax of the k logits). The loss is
`-Σ_{v in top-k} p(v) log q(v)`, q the draft's full-vocabulary softmax, weighted and normalized as the CE
(`losses.common.slot_cross_entropy`). The hard label, read by the accuracy and `tau_est` metrics and the DFlash2
selector, is the top-1 token, i.e. `target_argmax`'s. Other positions keep their data token with probability 1. Only
`[b, S, k]` tensors are kept: no `[S, vocab]` tensor exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dflash_hf.objective.blocks import label_positions
from dflash_hf.objective.labels.base import Labels, LabelSource, SoftLabels

if TYPE_CHECKING:
    from dflash_hf.targets.frozen import FrozenTarget


@dataclass
class TargetDistribution(LabelSource):
    label_top_k: int  # target tokens kept per position

    name = "target_distribution"
    needs_final_hidden = True
    soft = True

    def check(self, vocab_size: int) -> None:
        if not 1 <= self.label_top_k <= vocab_size:
            raise ValueError(f"label_top_k {self.label_top_k} must be in [1, vocab_size {vocab_size}]: lower it")

    def __call__(self, target: FrozenTarget, final_hidden, input_ids, plan) -> Labels:
        soft = topk_distribution(
            target.label_logits,
            final_hidden,
            input_ids,
            plan.loss_mask,
            plan.doc_ids,
            self.label_top_k,
            self.target_argmax_chunk_size,
        )
        return Labels(ids=soft.ids[..., 0], soft=soft)


@torch.no_grad()
def topk_distribution(
    logits_of,  # final hidden [m, H] -> logits [m, V]: the target's `label_logits` (or a bare lm_head)
    final_hidden: torch.Tensor,  # [b, S, H] final-normed states
    input_ids: torch.Tensor,  # [b, S]
    loss_mask: torch.Tensor,  # [b, S]
    doc_ids: torch.Tensor,  # [b, S], -1 on padding
    top_k: int,
    chunk_size: int,  # `target_argmax_chunk_size`
) -> SoftLabels:
    """Top-k next-token ids and renormalized probabilities `[b, S, k]` (descending), `chunk_size` positions at a
    time; positions without a label keep their data token (probability 1, the other k-1 entries 0)."""
    if top_k < 1 or chunk_size < 1:
        raise ValueError(f"label_top_k and target_argmax_chunk_size must be >= 1, got {top_k} and {chunk_size}")
    ids = input_ids[..., None].repeat(1, 1, top_k)
    probs = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    probs[..., 0] = 1.0
    need = label_positions(loss_mask, doc_ids)
    # with CPU masks (as the plan keeps them) the positions are found without a device sync
    rows, cols = (i.to(final_hidden.device, non_blocking=True) for i in need.nonzero(as_tuple=True))
    for start in range(0, rows.numel(), chunk_size):
        r, c = rows[start : start + chunk_size], cols[start : start + chunk_size]
        logits, top = logits_of(final_hidden[r, c - 1]).topk(top_k, dim=-1)  # [chunk, k]
        ids[r, c] = top
        probs[r, c] = torch.softmax(logits.float(), dim=-1)
    return SoftLabels(ids=ids, probs=probs)
