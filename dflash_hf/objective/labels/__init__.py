"""Label sources, one file each, and the `--label_source` registry.

- `target_argmax.py`: the frozen target's greedy next token (the default);
- `ground_truth.py`: the data's own tokens;
- `target_distribution.py`: the frozen target's top-k next-token distribution (soft labels).

Every source returns `Labels` in row coordinates (leading padding already moved to the end): hard ids `[b, S]`,
which the accuracy / `tau_est` metrics and the DFlash2 selector read, and optionally soft labels `[b, S, k]`.
A new source is a `LabelSource` subclass in its own file, registered in `LABEL_SOURCES`; its options are fields of
`dflash_hf.settings.ObjectiveSettings`, their defaults and checks written there (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import fields

from dflash_hf.objective.labels.base import Labels, LabelSource, SoftLabels
from dflash_hf.objective.labels.ground_truth import GroundTruth
from dflash_hf.objective.labels.target_argmax import TargetArgmax
from dflash_hf.objective.labels.target_distribution import TargetDistribution
from dflash_hf.settings import ObjectiveSettings

LABEL_SOURCES: dict[str, type[LabelSource]] = {cls.name: cls for cls in (TargetArgmax, GroundTruth, TargetDistribution)}


def make_label_source(settings: ObjectiveSettings) -> LabelSource:
    """The registered label source `settings.label_source` (`--label_source`), its dataclass fields (e.g.
    `target_argmax_chunk_size`, `label_top_k`) read from the settings of the same name."""
    name = settings.label_source
    if name not in LABEL_SOURCES:
        raise ValueError(
            f"label_source {name!r} is not registered; choose one of {sorted(LABEL_SOURCES)} "
            "(a new source is a LabelSource in dflash_hf/objective/labels/, added to LABEL_SOURCES)"
        )
    cls = LABEL_SOURCES[name]
    return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})


__all__ = ["LABEL_SOURCES", "LabelSource", "Labels", "SoftLabels", "make_label_source"]
