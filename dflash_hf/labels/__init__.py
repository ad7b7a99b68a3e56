"""Label sources, one file each, and the `--label_source` registry.

- `target_argmax.py`: the frozen target's greedy next token (the default);
- `ground_truth.py`: the data's own tokens;
- `target_distribution.py`: the frozen target's top-k next-token distribution (soft labels).

Every source returns `Labels` in row coordinates (leading padding already moved to the end): hard ids `[b, S]`,
which the accuracy / `tau_est` metrics and the DFlash2 selector read, and optionally soft labels `[b, S, k]`.
A new source is a `LabelSource` subclass in its own file, registered in `LABEL_SOURCES` (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch


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
    runs on dense chunked logits: the fused lm_head + CE takes hard labels only)."""

    name: ClassVar[str]
    needs_final_hidden: ClassVar[bool] = False
    soft: ClassVar[bool] = False

    def __call__(self, target, final_hidden: torch.Tensor | None, input_ids: torch.Tensor, plan) -> Labels:
        """Labels of the micro-batch: `final_hidden` `[b, S, H]` and `input_ids` `[b, S]` in row coordinates on the
        device, `plan` the micro-batch's `BlockPlan` (its CPU `loss_mask` and `doc_ids` locate label positions)."""
        raise NotImplementedError


from .ground_truth import GroundTruth  # noqa: E402  (the sources subclass LabelSource above)
from .target_argmax import TargetArgmax  # noqa: E402
from .target_distribution import TargetDistribution  # noqa: E402

LABEL_SOURCES: dict[str, type[LabelSource]] = {cls.name: cls for cls in (TargetArgmax, GroundTruth, TargetDistribution)}


def make_label_source(name: str, **options) -> LabelSource:
    """The registered label source `name` (`--label_source`); `options` fill its dataclass fields of the same name
    (e.g. `target_argmax_chunk_size`, `label_top_k`), the others are ignored."""
    if name not in LABEL_SOURCES:
        raise ValueError(f"label_source {name!r} is not registered; choose one of {sorted(LABEL_SOURCES)} "
                         "(a new source is a LabelSource in dflash_hf/labels/, added to LABEL_SOURCES)")
    cls = LABEL_SOURCES[name]
    return cls(**{f.name: options[f.name] for f in fields(cls) if f.name in options})


__all__ = ["LABEL_SOURCES", "LabelSource", "Labels", "SoftLabels", "make_label_source"]
