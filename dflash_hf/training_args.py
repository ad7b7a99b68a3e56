"""`DFlashTrainingArguments`: HF `TrainingArguments` plus the DFlash settings (DESIGN 6)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from .adaptation import DEFAULT_LORA_TARGETS, LORA_TARGETS
from .configuration_dflash import DFLASH_VARIANTS


@dataclass
class DFlashTrainingArguments(TrainingArguments):
    """Optimizer and schedule come from the standard fields. Defaults here: AdamW, lr 6e-4, constant
    schedule. An adaptation schedule is `learning_rate=1.5e-4, lr_scheduler_type=cosine_with_min_lr,
    lr_scheduler_kwargs={min_lr: 1e-6}, warmup_steps=500, max_steps=8000` (examples/configs/adapt.yaml)."""

    # --- standard fields with DFlash defaults ----------------------------------------------------
    learning_rate: float = field(default=6e-4, metadata={"help": "AdamW learning rate (DFlash default 6e-4)."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "LR schedule (default constant)."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: DFlash batches carry audio and loss-mask keys."}
    )
    report_to: str | list[str] = field(default="none", metadata={"help": "Loggers: none, tensorboard, wandb, ..."})
    save_safetensors: bool = field(default=True, metadata={"help": "Checkpoints in safetensors."})

    # --- target ---------------------------------------------------------------------------------
    target_name_or_path: str | None = field(
        default=None, metadata={"help": "Local directory (or cached hub id) of the frozen target."}
    )
    target_strict_load: bool = field(
        default=True,
        metadata={"help": "Require every target parameter in its checkpoint. False = intentional partial init."},
    )
    precision: str = field(
        default="fp32",
        metadata={"help": "Parameter dtype of target AND draft: fp32 or bf16 (no autocast)."},
    )

    # --- draft ----------------------------------------------------------------------------------
    variant: str = field(default="dflash", metadata={"help": "dflash or dflash2."})
    block_size: int = field(default=16, metadata={"help": "Draft slots per anchor (anchor + B-1 predictions)."})
    num_draft_layers: int = field(default=5, metadata={"help": "Decoder layers of a new draft."})
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "0-based target decoder layers to tap; default spreads 1..L-3."}
    )
    mask_token_id: int | None = field(
        default=None, metadata={"help": "Reserved token id with a row in the target embedding, unused by the data."}
    )
    init_from_pretrained: str | None = field(
        default=None, metadata={"help": "Warm start: a draft export directory (weights only, strict)."}
    )
    export_dir: str | None = field(
        default=None, metadata={"help": "Where the final draft is exported (default: <output_dir>/draft)."}
    )

    # --- blocks and loss ------------------------------------------------------------------------
    num_anchors: int = field(default=512, metadata={"help": "Anchors (blocks) sampled per row."})
    anchor_pad_multiple: int = field(
        default=8, metadata={"help": "Round the per-batch anchor count up to this (fewer compiled shapes)."}
    )
    gamma: float | None = field(
        default=None, metadata={"help": "Slot decay w_k=exp(-(k-1)/gamma); default 7/5/4 for B=16/10/8."}
    )
    label_source: str = field(
        default="target_argmax",
        metadata={"help": "target_argmax (frozen target's greedy next token) or ground_truth (data tokens)."},
    )
    target_argmax_chunk_size: int = field(
        default=128, metadata={"help": "Supervised positions projected per chunk for target_argmax labels."}
    )
    attention_backend: str = field(
        default="auto", metadata={"help": "flex, sdpa (dense mask) or auto (flex on CUDA, sdpa on CPU)."}
    )
    ce_chunk_size: int = field(
        default=2048, metadata={"help": "Draft slots projected to the vocabulary per chunk in the loss."}
    )
    validate_only: bool = field(default=False, metadata={"help": "Only evaluate the draft; no training."})

    # --- adaptation (docs/ADAPTATION.md) ----------------------------------------------------------
    projection_only: bool = field(
        default=False,
        metadata={"help": "Train only fc.weight (tap projection) of a warm-started draft; needs init_from_pretrained."},
    )
    lora_r: int = field(default=0, metadata={"help": "LoRA rank on the draft (peft); 0 = off. Merged on export."})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        metadata={"help": f"Draft linear layers that get LoRA adapters; any of {', '.join(LORA_TARGETS)}."},
    )

    def __post_init__(self):
        if self.bf16 or self.fp16:
            raise ValueError(
                "--bf16/--fp16 (autocast) are not used by dflash_hf: set --precision bf16, which sets the "
                "parameter dtype of both the frozen target and the draft"
            )
        super().__post_init__()
        if self.variant not in DFLASH_VARIANTS:
            raise ValueError(f"variant must be one of {DFLASH_VARIANTS}, got {self.variant!r}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, got {self.precision!r}")
        if self.label_source not in ("target_argmax", "ground_truth"):
            raise ValueError(f"label_source must be target_argmax or ground_truth, got {self.label_source!r}")
        if self.target_argmax_chunk_size <= 0:
            raise ValueError(f"target_argmax_chunk_size must be > 0, got {self.target_argmax_chunk_size}")
        if self.attention_backend not in ("auto", "flex", "sdpa"):
            raise ValueError(f"attention_backend must be auto, flex or sdpa, got {self.attention_backend!r}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {self.num_anchors}")
        self._check_adaptation()

    def _check_adaptation(self) -> None:
        if self.projection_only and not self.init_from_pretrained:
            raise ValueError(
                "projection_only=true trains only fc.weight of a pretrained draft: set init_from_pretrained to "
                "the draft export to adapt (or set projection_only=false to train a new draft)"
            )
        if self.lora_r < 0:
            raise ValueError(f"lora_r must be >= 0 (0 = LoRA off), got {self.lora_r}")
        if self.lora_r > 0:
            if not self.init_from_pretrained:
                raise ValueError(
                    "lora_r > 0 adapts a pretrained draft: set init_from_pretrained to the draft export "
                    "(a new draft is trained in full; set lora_r=0)"
                )
            if self.projection_only:
                raise ValueError("projection_only and lora_r > 0 are exclusive: pick one adaptation mode")
            if self.lora_alpha <= 0:
                raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha}")
            if not 0.0 <= self.lora_dropout < 1.0:
                raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
            bad = [m for m in self.lora_target_modules if m not in LORA_TARGETS]
            if bad or not self.lora_target_modules:
                raise ValueError(
                    f"lora_target_modules {list(self.lora_target_modules)}: {bad or 'empty'} are not draft linear "
                    f"layers; choose from {list(LORA_TARGETS)}"
                )
        if self.activation_checkpointing:
            # Block inputs come from the frozen target embedding, so reentrant checkpointing would drop the
            # gradients of everything inside a checkpointed layer (nothing entering it requires grad).
            kwargs = dict(self.activation_checkpointing_kwargs or {})
            if kwargs.get("use_reentrant", False):
                raise ValueError(
                    "gradient_checkpointing_kwargs.use_reentrant=True drops draft gradients (the draft's block "
                    "inputs come from the frozen embedding); use use_reentrant=False (the default here)"
                )
            kwargs["use_reentrant"] = False
            self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs = kwargs

    @property
    def resolved_export_dir(self) -> str:
        return self.export_dir or f"{self.output_dir}/draft"
