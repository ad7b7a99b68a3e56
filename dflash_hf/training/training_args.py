"""`DFlashTrainingArguments`: HF `TrainingArguments` plus the DFlash settings; `DFlashDataArguments`: the data
settings, parsed beside it (docs/ARCHITECTURE.md).

Every DFlash field, with its default, help and own checks, is a field of a settings class of `dflash_hf.settings`
(light: `dflash-train --help` is made from them without torch). `DFlashTrainingArguments` combines
`TrainingArguments` with `TRAINING_SETTINGS` and adds the checks that need several of them, the environment, the
device or a file.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import TrainingArguments

from dflash_hf.export.drafts import check_warm_start_export
from dflash_hf.models.draft_fields import check_block_size
from dflash_hf.settings import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_NUM_ANCHORS,
    TRAINER_OVERRIDES,
    TRAINER_RANGES,
    TRAINING_SETTINGS,
    AdaptationSettings,
    DataSettings,
    DraftSettings,
    ModelSettings,
    ObjectiveSettings,
    RunSettings,
    check_ranges,
)
from dflash_hf.settings.run import COMPILE_LAYER_CHOICES, LORA_TARGETS, deprecated_options
from dflash_hf.training.checkpoints import check_checkpoint_dir, parse_resume_flag, resume_path
from dflash_hf.training.launch import check_launch

if TYPE_CHECKING:  # lhotse is imported only when speech data is used
    from dflash_hf.data import ConversationConfig, DataSource

__all__ = ["DFlashDataArguments", "DFlashTrainingArguments"]


def _override(name: str):
    default, help_text = TRAINER_OVERRIDES[name]
    return field(default=default, metadata={"help": help_text})


@dataclass
class DFlashTrainingArguments(
    TrainingArguments,
    ModelSettings,
    DraftSettings,
    ObjectiveSettings,
    AdaptationSettings,
    RunSettings,
):
    """Optimizer and schedule come from the standard fields. Defaults here: AdamW, lr 6e-4, constant
    schedule. An adaptation schedule is `learning_rate=1.5e-4, lr_scheduler_type=cosine_with_min_lr,
    lr_scheduler_kwargs={min_lr: 1e-6}, warmup_steps=500, max_steps=8000` (examples/configs/adapt.yaml)."""

    # --- standard fields with DFlash defaults (settings.TRAINER_OVERRIDES) -------------------------
    learning_rate: float = _override("learning_rate")
    lr_scheduler_type: str = _override("lr_scheduler_type")
    weight_decay: float = _override("weight_decay")
    remove_unused_columns: bool = _override("remove_unused_columns")
    save_safetensors: bool = _override("save_safetensors")
    logging_nan_inf_filter: bool = _override("logging_nan_inf_filter")
    push_to_hub: bool = _override("push_to_hub")
    hub_model_id: str | None = _override("hub_model_id")
    resume_from_checkpoint: str | None = _override("resume_from_checkpoint")
    ddp_find_unused_parameters: bool | None = _override("ddp_find_unused_parameters")

    def __post_init__(self):
        if self.bf16 or self.fp16:
            raise ValueError(
                "--bf16/--fp16 (autocast) are not used by dflash_hf: set --precision bf16, which sets the "
                "parameter dtype of both the frozen target and the draft"
            )
        self._apply_deprecated_options()
        check_ranges(self, TRAINER_RANGES)  # the inherited options' ranges
        for settings in TRAINING_SETTINGS:  # each settings class's own checks (ranges, choices, block size, ...)
            settings.validate(self)
        self._check_skip_oom_batches()
        check_launch(self)  # before the devices are set up
        super().__post_init__()
        self._default_unrecorded()
        self.resume_from_checkpoint = parse_resume_flag(self.resume_from_checkpoint)
        self._check_objective()
        self._check_attention_backend()
        self._check_hub()
        self._check_adaptation()
        self._check_float8()

    def _apply_deprecated_options(self) -> None:
        """Old option names still work, each with a warning naming its replacement; `torch_compile_layers` is
        checked here (the parser checks its choices, a Python caller may pass anything)."""
        found = deprecated_options(self)
        for name, replacement in found.items():
            warnings.warn(
                f"{name}=true is deprecated and will be removed; set {replacement} instead", FutureWarning, stacklevel=3
            )
        layers = list(self.torch_compile_layers or [])
        renamed = (("compile_draft_layers", "draft"), ("compile_target", "target"))
        layers += [layer for name, layer in renamed if name in found]
        bad = [layer for layer in layers if layer not in COMPILE_LAYER_CHOICES]
        if bad:
            raise ValueError(
                f"torch_compile_layers {layers}: {bad} are not models with decoder layers to compile; choose from "
                f"{list(COMPILE_LAYER_CHOICES)}"
            )
        self.torch_compile_layers = sorted(set(layers), key=COMPILE_LAYER_CHOICES.index)
        self.compile_draft_layers = self.compile_target = False  # merged into torch_compile_layers (warned once)

    def _default_unrecorded(self) -> None:
        """Unset block_size / num_anchors take their defaults now, unless the init_from_pretrained export may record
        them (`check_files` reads it: nothing here reads a file)."""
        if self.block_size is None and not self.init_from_pretrained:
            self.block_size = DEFAULT_BLOCK_SIZE
        if self.num_anchors is None and not (self.validate_only and self.init_from_pretrained):
            self.num_anchors = DEFAULT_NUM_ANCHORS

    def check_files(self) -> None:
        """What the arguments need from files, before anything loads (the CLI's pre-flight; `DFlashTrainer` and
        `validate` call it too, so Python callers get the same checks): the resume checkpoint and the warm-start export
        must be complete, and block_size / num_anchors left unset come from that export (its block size and, with
        validate_only, the training run's anchors recorded in its dflash_config, so a validation repeats the run's
        evaluation). Idempotent."""
        if resume_path(self.resume_from_checkpoint) is not None:
            check_checkpoint_dir(self.resume_from_checkpoint)
        # a missing or broken draft export fails before the target loads
        recorded = check_warm_start_export(self.init_from_pretrained) if self.init_from_pretrained else {}
        if self.block_size is None:
            self.block_size = recorded.get("block_size", DEFAULT_BLOCK_SIZE)
            check_block_size(self.block_size)
        if self.num_anchors is None:
            self.num_anchors = recorded.get("num_anchors", DEFAULT_NUM_ANCHORS)

    def _check_skip_oom_batches(self) -> None:
        """Skipping a step that ran out of GPU memory is for one process: under DDP the other ranks would wait for
        the skipped step's gradients in their all-reduce."""
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if self.skip_oom_batches and (world > 1 or self.deepspeed):
            raise ValueError(
                f"skip_oom_batches={self.skip_oom_batches} needs a single process (here "
                + ("DeepSpeed" if self.deepspeed else f"WORLD_SIZE={world}")
                + "): a rank that skips a step would leave the others waiting for its gradients. Set "
                "skip_oom_batches=0 and lower the step's memory instead (--max_tokens, --num_anchors)"
            )

    def _check_hub(self) -> None:
        if not self.push_to_hub:
            return
        if self.validate_only:
            raise ValueError(
                "push_to_hub=true publishes the draft this run trains; validate_only=true trains none (publish an "
                "export with dflash_hf.export.hub.push_draft_to_hub)"
            )
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(self.hub_model_id or "")
        except HFValidationError as err:
            raise ValueError(
                f"push_to_hub=true publishes the exported draft to hub_model_id, which must be a Hub repo id "
                f"(org/name), got {self.hub_model_id!r}"
            ) from err

    def _device_type(self) -> str:
        """The device type the Trainer will train on (`use_cpu`, else the first accelerator present), known before
        its devices are set up."""
        import torch

        if self.use_cpu:
            return "cpu"
        accelerators = {
            "cuda": torch.cuda.is_available,
            "mps": torch.backends.mps.is_available,
            "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
        }
        return next((name for name, present in accelerators.items() if present()), "cpu")

    def _check_attention_backend(self) -> None:
        if self.attention_backend == "flex" and not self.validate_only:
            if self._device_type() != "cuda":
                raise ValueError(
                    "attention_backend=flex trains on CUDA only (FlexAttention has no backward on CPU); "
                    "use attention_backend=sdpa (or auto: flex on CUDA, sdpa on CPU)"
                )

    def _check_float8(self) -> None:
        flags = tuple(name for name in ("float8_draft_linears", "float8_lm_head") if getattr(self, name))
        if not flags or self.validate_only:  # (a validation trains nothing)
            return
        import torch

        from dflash_hf.ops.float8 import check_float8_device, options_set

        if self.float8_draft_linears and self.lora_r > 0:
            raise ValueError(
                "float8_draft_linears=true converts the draft's own linear layers, which lora_r > 0 wraps "
                "in peft's LoRA layers: set float8_draft_linears=false or lora_r=0"
            )
        if self.float8_lm_head and not self.use_fused_linear_ce:
            raise ValueError(
                "float8_lm_head=true runs in the fused lm_head + CE, which this run does not use "
                "(use_fused_linear_ce=false; DFlash2, soft labels and loss types weighted by the draft's "
                "own CE need the dense logits): set float8_lm_head=false"
            )
        device = self._device_type()
        check_float8_device(torch.device(device), flags)
        if device == "cuda" and self.precision != "bf16":
            raise ValueError(
                f"{options_set(flags, 'true')} on a GPU needs precision=bf16 (FP8 matmuls with per-row "
                f"scales write bf16 there), got precision={self.precision!r}"
            )

    def _check_objective(self) -> None:
        from dflash_hf.objective.dflash_objective import resolve_fused_ce
        from dflash_hf.objective.labels import LABEL_SOURCES
        from dflash_hf.objective.losses import LOSSES

        for name, registry in (("label_source", LABEL_SOURCES), ("loss_type", LOSSES)):
            if getattr(self, name) not in registry:
                raise ValueError(f"{name} must be one of {sorted(registry)}, got {getattr(self, name)!r}")
        self.use_fused_linear_ce = resolve_fused_ce(self, self.variant)

    def _check_adaptation(self) -> None:
        if self.projection_only and not self.init_from_pretrained:
            raise ValueError(
                "projection_only=true trains only fc.weight of a pretrained draft: set init_from_pretrained to "
                "the draft export to adapt (or set projection_only=false to train a new draft)"
            )
        if self.lora_r > 0:
            if not self.init_from_pretrained:
                raise ValueError(
                    "lora_r > 0 adapts a pretrained draft: set init_from_pretrained to the draft export "
                    "(a new draft is trained in full; set lora_r=0)"
                )
            if self.projection_only:
                raise ValueError("projection_only and lora_r > 0 are exclusive: pick one adaptation mode")
            bad = [m for m in self.lora_target_modules if m not in LORA_TARGETS]
            if bad or not self.lora_target_modules:
                raise ValueError(
                    f"lora_target_modules {list(self.lora_target_modules)}: {bad or 'empty'} are not draft linear "
                    f"layers; choose from {list(LORA_TARGETS)}"
                )
        # transformers >= 5.23 names it activation_checkpointing (gradient_checkpointing stays an alias).
        if getattr(self, "activation_checkpointing", self.gradient_checkpointing):
            # Block inputs come from the frozen target embedding, so reentrant checkpointing would drop the
            # gradients of everything inside a checkpointed layer (nothing entering it requires grad).
            given = getattr(self, "activation_checkpointing_kwargs", None) or self.gradient_checkpointing_kwargs
            kwargs = dict(given or {})
            if kwargs.get("use_reentrant", False):
                raise ValueError(
                    "gradient_checkpointing_kwargs.use_reentrant=True drops draft gradients (the draft's block "
                    "inputs come from the frozen embedding); use use_reentrant=False (the default here)"
                )
            kwargs["use_reentrant"] = False
            self.gradient_checkpointing_kwargs = kwargs
            if hasattr(self, "activation_checkpointing_kwargs"):
                self.activation_checkpointing_kwargs = kwargs

    @property
    def resolved_export_dir(self) -> str:
        return self.export_dir or f"{self.output_dir}/draft"


@dataclass
class DFlashDataArguments(DataSettings):
    """The data options, parsed beside `DFlashTrainingArguments` (`DataSettings`: fields, defaults, checks), and the
    data sources and conversation they describe. Paths are checked by `check_data_paths` (the CLI's pre-flight), not
    here."""

    _argument_group_name = "DFlash data"

    def train_sources(self) -> list[DataSource] | None:
        from dflash_hf.data import DataSource

        if not self.train_data:
            return None
        weights = self.train_data_weights or [1.0] * len(self.train_data)
        return [DataSource(path=p, weight=w, **self._source_policy()) for p, w in zip(self.train_data, weights)]

    def eval_sources(self) -> dict[str, DataSource] | None:
        from dflash_hf.data import DataSource

        if not self.eval_data:
            return None
        out: dict[str, DataSource] = {}
        for item in self.eval_data:
            name, path = item.split("=", 1) if "=" in item else (Path(item).name.split(".")[0], item)
            if name in out:
                raise ValueError(f"two eval_data sets are named {name!r}; name them explicitly as NAME=PATH")
            out[name] = DataSource(path=path, **self._source_policy())
        return out

    def _source_policy(self) -> dict[str, bool | float]:
        return {
            "allow_command_audio_sources": self.allow_command_audio_sources,
            "allow_url_audio_sources": self.allow_url_audio_sources,
            "max_chars_per_second": self.max_chars_per_second,
        }

    def conversation(self) -> ConversationConfig:
        from dflash_hf.data import ConversationConfig

        return ConversationConfig(system_prompt=self.system_prompt, prompt=self.prompt)
