"""dflash_hf: train DFlash / DFlash2 speculative-decoding drafts against frozen speech LLMs, the HF way."""

from .configuration_dflash import DFlashConfig
from .modeling_dflash import DFlash2DraftModel, DFlashDraftModel
from .speculative import speculative_generate
from .trainer import DFlashTrainer
from .training_args import DFlashTrainingArguments

__all__ = [
    "DFlash2DraftModel",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashTrainer",
    "DFlashTrainingArguments",
    "speculative_generate",
]
__version__ = "0.1.0"
