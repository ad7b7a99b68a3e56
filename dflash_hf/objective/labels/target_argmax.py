"""`--label_source target_argmax` (the default): `label[t] = argmax lm_head(final_norm(h[t-1]))` of the frozen target
at every supervised t whose predecessor is a real token of the same document (`target_argmax_labels`, chunked
by `--target_argmax_chunk_size`, no `[S, vocab]` logits); other positions keep their data token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dflash_hf.objective.blocks import label_positions
from dflash_hf.objective.labels.base import Labels, LabelSource

if TYPE_CHECKING:
    from dflash_hf.targets.frozen import FrozenTarget


@dataclass
class TargetArgmax(LabelSource):
    name = "target_argmax"
    needs_final_hidden = True
    greedy = True

    def __call__(self, target: FrozenTarget, final_hidden, input_ids, plan) -> Labels:
        ids = target_argmax_labels(
            target, final_hidden, input_ids, plan.loss_mask, plan.doc_ids, self.target_argmax_chunk_size
        )
        return Labels(ids=ids)


@torch.no_grad()
def target_argmax_labels(
    target,
    final_hidden: torch.Tensor,  # [b, S, H] final-normed states
    input_ids: torch.Tensor,  # [b, S]
    loss_mask: torch.Tensor,  # [b, S]
    doc_ids: torch.Tensor,  # [b, S], -1 on padding
    chunk_size: int,  # `target_argmax_chunk_size`
) -> torch.Tensor:
    """`label[t] = argmax(target.label_logits(final_hidden[t-1]))` for supervised t whose predecessor is a real token of
    the same document; other positions keep their id. Only those, `chunk_size` at a time: no `[S, V]` logits."""
    if chunk_size <= 0:
        raise ValueError(f"target_argmax_chunk_size must be > 0, got {chunk_size}")
    labels = input_ids.clone()
    need = label_positions(loss_mask, doc_ids)
    # with CPU masks (as the trainer's plan keeps them) the positions are found without a device sync
    rows, cols = (i.to(final_hidden.device, non_blocking=True) for i in need.nonzero(as_tuple=True))
    for start in range(0, rows.numel(), chunk_size):
        r, c = rows[start : start + chunk_size], cols[start : start + chunk_size]
        logits = target.label_logits(final_hidden[r, c - 1])  # [chunk, V]
        labels[r, c] = logits.argmax(-1)
    return labels
