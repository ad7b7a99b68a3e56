"""dflash_hf: train DFlash / DFlash2 speculative-decoding drafts against frozen speech LLMs, the HF way.

The public names are imported on first use, so light entry points (`dflash-train --help`) do not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "DFlash2DraftModel": ".modeling_dflash",
    "DFlashConfig": ".configuration_dflash",
    "DFlashDraftModel": ".modeling_dflash",
    "DFlashTrainer": ".trainer",
    "DFlashTrainingArguments": ".training_args",
    "speculative_generate": ".speculative",
}

if TYPE_CHECKING:
    from .configuration_dflash import DFlashConfig
    from .modeling_dflash import DFlash2DraftModel, DFlashDraftModel
    from .speculative import speculative_generate
    from .trainer import DFlashTrainer
    from .training_args import DFlashTrainingArguments


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
    "speculative_generate",
]
__version__ = "0.1.0"
