"""dflash_hf: train DFlash / DFlash2 speculative-decoding drafts against frozen speech LLMs, the HF way.

The public names are imported on first use, so light entry points (`dflash-train --help`) do not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "DFlash2DraftModel": ".models.modeling_dflash",
    "DFlashConfig": ".models.configuration_dflash",
    "DFlashDraftModel": ".models.modeling_dflash",
    "DFlashTrainer": ".training.trainer",
    "DFlashTrainingArguments": ".training.training_args",
    "build_target_and_draft": ".targets.builder",
    "dflash_custom_generate": ".generation.speculative",
    "export_draft": ".export.drafts",
    "load_draft_strict": ".export.drafts",
    "load_target": ".targets.frozen",
    "push_draft_to_hub": ".export.hub",
    "speculative_generate": ".generation.speculative",
}

if TYPE_CHECKING:
    from dflash_hf.export.drafts import export_draft, load_draft_strict
    from dflash_hf.export.hub import push_draft_to_hub
    from dflash_hf.generation.speculative import dflash_custom_generate, speculative_generate
    from dflash_hf.models.configuration_dflash import DFlashConfig
    from dflash_hf.models.modeling_dflash import DFlash2DraftModel, DFlashDraftModel
    from dflash_hf.targets.builder import build_target_and_draft
    from dflash_hf.targets.frozen import load_target
    from dflash_hf.training.trainer import DFlashTrainer
    from dflash_hf.training.training_args import DFlashTrainingArguments


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "DFlash2DraftModel",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashTrainer",
    "DFlashTrainingArguments",
    "build_target_and_draft",
    "dflash_custom_generate",
    "export_draft",
    "load_draft_strict",
    "load_target",
    "push_draft_to_hub",
    "speculative_generate",
]
__version__ = "0.1.0"
