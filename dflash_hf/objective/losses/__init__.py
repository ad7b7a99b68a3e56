"""Losses, one file each, and the `--loss_type` registry.

- `ce.py`: the decayed block CE (`--loss_type ce`, the default) and `block_loss`;
- `dpace.py`: D-PACE position-aware weights (`--loss_type dpace`);
- `selector.py`: DFlash2's base + path-selector losses;
- `fused_ce.py`: the fused lm_head + CE kernel; `common.py`: valid slots, chunking, per-slot CE;
- `metrics.py`: acceptance sums and `MetricSums`.

A new loss is a `SlotLoss` subclass in its own file, registered in `LOSSES` below; its options are fields of
`dflash_hf.settings.ObjectiveSettings`, their defaults and checks written there (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import fields

from dflash_hf.objective.losses.ce import DecayedCE, block_loss
from dflash_hf.objective.losses.common import BlockLoss, SlotLoss, ValidSlots, map_chunks
from dflash_hf.objective.losses.dpace import DPACE
from dflash_hf.objective.losses.metrics import MetricSums, acceptance_sum
from dflash_hf.objective.losses.selector import DFlash2BlockLoss, dflash2_block_loss
from dflash_hf.ops.fused_ce import fused_lm_head_ce
from dflash_hf.settings import ObjectiveSettings

LOSSES: dict[str, type[SlotLoss]] = {cls.name: cls for cls in (DecayedCE, DPACE)}


def make_loss(settings: ObjectiveSettings) -> SlotLoss:
    """The registered loss `settings.loss_type` (`--loss_type`), its dataclass fields (e.g. `dpace_alpha`) read from
    the settings of the same name."""
    name = settings.loss_type
    if name not in LOSSES:
        raise ValueError(
            f"loss_type {name!r} is not registered; choose one of {sorted(LOSSES)} "
            "(a new loss is a SlotLoss in dflash_hf/objective/losses/, added to LOSSES)"
        )
    cls = LOSSES[name]
    return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})


__all__ = [
    "LOSSES",
    "BlockLoss",
    "DFlash2BlockLoss",
    "DPACE",
    "DecayedCE",
    "MetricSums",
    "SlotLoss",
    "ValidSlots",
    "acceptance_sum",
    "block_loss",
    "dflash2_block_loss",
    "fused_lm_head_ce",
    "make_loss",
    "map_chunks",
]
