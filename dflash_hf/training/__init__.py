"""Training a draft with the Hugging Face `Trainer`: `DFlashTrainer` (the Trainer hooks, calling the objective),
`DFlashTrainingArguments` and `DFlashDataArguments` (`TrainingArguments` plus the settings), what the trainer is built
from, callbacks, checkpoints, the run record and fault handling. Public names are imported on first use
(`dflash_hf.lazy`), so `dflash-train --help` loads no torch."""

from dflash_hf.lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".trainer": ["DFlashTrainer"],
        ".training_args": ["DFlashDataArguments", "DFlashTrainingArguments"],
        ".validate_only": ["validate"],
    },
)
