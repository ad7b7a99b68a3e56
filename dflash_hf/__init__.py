"""dflash_hf: train DFlash / DFlash2 speculative-decoding drafts against frozen speech LLMs, the HF way.

The public names are imported on first use (`dflash_hf.lazy`), so light entry points (`dflash-train --help`) do not
load torch. Each folder exports its own public names the same way (`dflash_hf.targets.FrozenTarget`, ...).
"""

from __future__ import annotations

from dflash_hf.lazy import lazy_exports

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
