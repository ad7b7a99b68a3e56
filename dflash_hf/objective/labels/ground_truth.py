"""`--label_source ground_truth`: the data's own tokens (slot k of the block at anchor a learns the token at a+k)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_hf.objective.labels.base import Labels, LabelSource

if TYPE_CHECKING:
    from dflash_hf.targets.frozen import FrozenTarget


@dataclass
class GroundTruth(LabelSource):
    name = "ground_truth"

    def __call__(self, target: FrozenTarget, final_hidden, input_ids, plan) -> Labels:
        return Labels(ids=input_ids)
