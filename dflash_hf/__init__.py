"""dflash_hf: train DFlash / DFlash2 speculative-decoding drafts against frozen speech LLMs, the HF way.

The public names are imported on first use (`dflash_hf.lazy`), so light entry points (`dflash-train --help`) do not
load torch. Each folder exports its own public names the same way (`dflash_hf.targets.FrozenTarget`, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_hf.lazy import lazy_exports

if TYPE_CHECKING:  # static types for editors and type checkers; at run time each name loads on first use
    from dflash_hf.export.drafts import export_draft as export_draft
    from dflash_hf.export.drafts import load_draft_strict as load_draft_strict
    from dflash_hf.export.hub import push_draft_to_hub as push_draft_to_hub
    from dflash_hf.generation.speculative import dflash_custom_generate as dflash_custom_generate
    from dflash_hf.generation.speculative import speculative_generate as speculative_generate
    from dflash_hf.models.configuration_dflash import DFlashConfig as DFlashConfig
    from dflash_hf.models.modeling_dflash import DFlash2DraftModel as DFlash2DraftModel
    from dflash_hf.models.modeling_dflash import DFlashDraftModel as DFlashDraftModel
    from dflash_hf.targets.builder import build_target_and_draft as build_target_and_draft
    from dflash_hf.targets.frozen import load_target as load_target
    from dflash_hf.training.trainer import DFlashTrainer as DFlashTrainer
    from dflash_hf.training.training_args import DFlashTrainingArguments as DFlashTrainingArguments

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".export.drafts": ["export_draft", "load_draft_strict"],
        ".export.hub": ["push_draft_to_hub"],
        ".generation.speculative": ["dflash_custom_generate", "speculative_generate"],
        ".models.configuration_dflash": ["DFlashConfig"],
        ".models.modeling_dflash": ["DFlash2DraftModel", "DFlashDraftModel"],
        ".targets.builder": ["build_target_and_draft"],
        ".targets.frozen": ["load_target"],
        ".training.trainer": ["DFlashTrainer"],
        ".training.training_args": ["DFlashTrainingArguments"],
    },
)

__version__ = "0.1.0"
