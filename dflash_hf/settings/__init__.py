"""Every DFlash setting in one place: typed dataclasses whose fields carry their default and `--help` text, checked
once when built (light: no torch, no transformers, so `dflash-train --help` and argument errors stay fast).

| class | what it sets | read by |
| --- | --- | --- |
| `ModelSettings` | the frozen target, the warm-start export, where the draft is exported | the training arguments |
| `DraftSettings` | variant, size, taps, mask id, block size, DFlash2's fields | the training arguments |
| `ObjectiveSettings` | anchors, labels, loss, packing, chunk sizes | `DFlashObjective`, its label sources and losses |
| `AdaptationSettings`, `RunSettings` | LoRA, projection-only; validation, real tau, stopping, ... | the trainer |
| `DataSettings` (`BatchSettings`) | sources, prompts, audio policy, token budget, bad samples | the data arguments |
| `LoaderSettings` (`BatchSettings`) | the whole set a training loader is built from | `data.build_train_dataloader` |

`DFlashTrainingArguments` is `TrainingArguments` plus the first five (`TRAINER_OVERRIDES`: the inherited options
whose DFlash default differs), `DFlashDataArguments` is `DataSettings`; `training.argument_groups` only arranges their
fields into `--help` groups.

The values the draft config itself needs (variants, block sizes, DFlash2's fields and their checks) live in
`dflash_hf/models/draft_fields.py`: that file is remote code, copied into every export beside
`configuration_dflash.py`, which may import only torch, transformers and its sibling files, so it cannot import this
package; this package imports it (it is pure Python) and shows its values as its own. Either way each default is
written once.
"""

from dflash_hf.models.draft_fields import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_NUM_DRAFT_LAYERS,
    DEFAULT_VARIANT,
    DFLASH_VARIANTS,
    MAX_BLOCK_SIZE,
    DFlash2Fields,
)
from dflash_hf.settings.checks import Range, Settings, check_ranges, range_problem, setting
from dflash_hf.settings.data import BatchSettings, DataSettings, LoaderSettings
from dflash_hf.settings.draft import DraftSettings, ModelSettings
from dflash_hf.settings.objective import DEFAULT_NUM_ANCHORS, ObjectiveSettings
from dflash_hf.settings.run import AdaptationSettings, RunSettings
from dflash_hf.settings.trainer import TRAINER_OVERRIDES, TRAINER_RANGES

# The settings classes `DFlashTrainingArguments` combines (with TrainingArguments), in the order they are checked.
TRAINING_SETTINGS = (ModelSettings, DraftSettings, ObjectiveSettings, AdaptationSettings, RunSettings)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_NUM_ANCHORS",
    "DEFAULT_NUM_DRAFT_LAYERS",
    "DEFAULT_VARIANT",
    "DFLASH_VARIANTS",
    "MAX_BLOCK_SIZE",
    "TRAINER_OVERRIDES",
    "TRAINER_RANGES",
    "TRAINING_SETTINGS",
    "AdaptationSettings",
    "BatchSettings",
    "DFlash2Fields",
    "DataSettings",
    "DraftSettings",
    "LoaderSettings",
    "ModelSettings",
    "ObjectiveSettings",
    "Range",
    "RunSettings",
    "Settings",
    "check_ranges",
    "range_problem",
    "setting",
]
