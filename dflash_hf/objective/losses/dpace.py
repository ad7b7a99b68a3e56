"""`--loss_type dpace`: D-PACE, dynamic position-aware cross-entropy.

Definition (Dynamic Position-Aware Cross-Entropy for Parallel Speculative Drafting, arXiv:2605.18810, Eq. 7-9; as
the public DFlash trainers added it: sgl-project/SpecForge#578 and its normalization fix #848, NVIDIA/Model-Optimizer
#1724, lightseekorg/TorchSpec#117). Per block, with the draft's detached confidence in the label
`q_k = exp(-CE_k)` at slot k:

- smoothing (Eq. 7): `q~_k = (1 - alpha) * q_k + alpha` (`--dpace_alpha`; its default is the paper's);
- weights (Eq. 8): `w_j = Σ_{m >= j} Π_{i <= m} q~_i`, the derivative of the block's expected accepted length
  with respect to slot j's log-confidence: a slot counts for every later slot whose acceptance needs it;
- loss (Eq. 9): `Σ_j w_j · CE_j`, weights detached (they shape the gradient, none flows through them).

Here, as the paper's author asked for in SpecForge#828 (dividing by `Σ w` cancels the credit mass), the loss is
divided by the number of blocks, counted over the global batch like the decayed CE's denominator: it is known at
planning time. An invalid slot (past the document or row end, or unsupervised) has `q~ = 0`: acceptance cannot
continue past it (as in `tau_est`), so it ends the block's chain and gets no weight. The static decay is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_hf.objective.blocks import Blocks
from dflash_hf.objective.losses.common import SlotLoss, ValidSlots


@dataclass
class DPACE(SlotLoss):
    dpace_alpha: float  # smoothing alpha of Eq. 7 (`--dpace_alpha`)

    name = "dpace"
    weights_before_forward = False

    def planned_denominator(self, valid: torch.Tensor, gamma: float) -> torch.Tensor:
        return valid.any(-1).sum().float()

    def denominator(self, slots: ValidSlots, blocks: Blocks, weights: torch.Tensor) -> torch.Tensor:
        return blocks.valid.any(-1).sum().float()

    def weights(self, slots: ValidSlots, ce: torch.Tensor) -> torch.Tensor:
        smoothed = torch.exp(-ce) * (1.0 - self.dpace_alpha) + self.dpace_alpha  # Eq. 7
        return dpace_weights(slots.scatter(smoothed)).flatten()[slots.index]


def dpace_weights(smoothed: torch.Tensor) -> torch.Tensor:
    """`w_j = Σ_{m >= j} Π_{i <= m} q~_i` along the last dimension of `smoothed` `[..., B-1]` (zeros end a chain)."""
    prefix = torch.cumprod(smoothed, dim=-1)
    return prefix.flip(-1).cumsum(-1).flip(-1) * (smoothed > 0)
