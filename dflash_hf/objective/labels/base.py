"""The label-source interface: `LabelSource` and what it returns (`Labels`, `SoftLabels`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from dflash_hf.targets.frozen import FrozenTarget


@dataclass
class SoftLabels:
    """Top-k soft labels: token ids and their probabilities (summing to 1 over the last dimension)."""

    ids: torch.Tensor  # [..., k] long
    probs: torch.Tensor  # [..., k] float32


@dataclass
class Labels:
    ids: torch.Tensor  # [b, S] hard label per position (row coordinates)
    soft: SoftLabels | None = None  # [b, S, k] soft labels, when the source has them


@dataclass
class LabelSource:
    """Turns a micro-batch's target features into labels. `needs_final_hidden`: the target's final-normed states
    must be captured (`FrozenTarget.capture(keep_final=True)`). `soft`: the source yields soft labels (the loss then
    runs on dense chunked logits: the fused lm_head + CE takes hard labels only). `greedy`: the hard labels are the
    target's greedy next token (`target_argmax_labels`), so the evaluation's `greedy_tau_est` reuses them.

    Fields are options of the same name in `ObjectiveSettings` (`make_label_source` fills them from there; no
    defaults here). Every source has `target_argmax_chunk_size`: the evaluation's greedy estimates compute the
    target's argmax with it whatever the labels are."""

    target_argmax_chunk_size: int  # supervised positions projected per chunk for the target's argmax

    name: ClassVar[str]
    needs_final_hidden: ClassVar[bool] = False
    soft: ClassVar[bool] = False
    greedy: ClassVar[bool] = False

    def check(self, vocab_size: int) -> None:
        """Refuse options the target's vocabulary cannot satisfy (before any forward)."""

    def __call__(
        self, target: FrozenTarget, final_hidden: torch.Tensor | None, input_ids: torch.Tensor, plan
    ) -> Labels:
        """Labels of the micro-batch: `final_hidden` `[b, S, H]` and `input_ids` `[b, S]` in row coordinates on the
        device, `plan` the micro-batch's `BlockPlan` (its CPU `loss_mask` and `doc_ids` locate label positions)."""
        raise NotImplementedError
