"""`DFlashTrainingArguments`: HF `TrainingArguments` plus the DFlash settings (docs/ARCHITECTURE.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import TrainingArguments

from .adaptation import DEFAULT_LORA_TARGETS, LORA_TARGETS
from .configuration_dflash import DEFAULT_BLOCK_SIZE, DEFAULT_GAMMA, DFLASH_VARIANTS, DFlash2Fields
from .hub import resolve_draft_dir

if TYPE_CHECKING:  # lhotse is imported only when speech data is used
    from .data import ConversationConfig, DataSource

_D2 = DFlash2Fields()


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
    save_safetensors: bool = field(default=True, metadata={"help": "Checkpoints in safetensors."})

    # --- target ---------------------------------------------------------------------------------
    target_name_or_path: str | None = field(
        default=None, metadata={"help": "Local directory (or cached hub id) of the frozen target."}
    )
    target_strict_load: bool = field(
        default=True,
        metadata={"help": "Require every target parameter in its checkpoint. False = intentional partial init."},
    )
    target_family: str | None = field(
        default=None,
        metadata={"help": "Target family row (docs/DATA.md); default from the config's model_type. "
                  "qwen2_audio_single_placeholder selects the model-side audio expansion (NeMo SALM layout)."},
    )
    precision: str = field(
        default="fp32",
        metadata={"help": "Parameter dtype of target AND draft: fp32 or bf16 (no autocast)."},
    )

    # --- draft ----------------------------------------------------------------------------------
    variant: str = field(default="dflash", metadata={"help": "dflash or dflash2."})
    block_size: int = field(
        default=DEFAULT_BLOCK_SIZE, metadata={"help": "Draft slots per anchor (anchor + B-1 predictions)."}
    )
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
        default=None,
        metadata={"help": f"Slot decay w_k=exp(-(k-1)/gamma); default by block size {DEFAULT_GAMMA}, else B/2."},
    )
    label_source: str = field(
        default="target_argmax",
        metadata={"help": "target_argmax (frozen target's greedy next token), ground_truth (data tokens) or "
                  "target_distribution (soft labels: the target's top label_top_k probabilities, renormalized)."},
    )
    label_top_k: int = field(
        default=8, metadata={"help": "label_source=target_distribution: target tokens kept per position."}
    )
    loss_type: str = field(
        default="ce",
        metadata={"help": "ce (slot-decayed cross-entropy) or dpace (D-PACE confidence-derived position weights)."},
    )
    dpace_alpha: float = field(
        default=0.5, metadata={"help": "loss_type=dpace: confidence smoothing alpha in (0, 1] (paper default 0.5)."}
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
    compile_draft_layers: bool = field(
        default=False,
        metadata={
            "help": "torch.compile each draft decoder layer on CUDA (docs/PERFORMANCE.md: 8B-shape draft step "
            "180 -> 151 ms). The second batch shape compiles dynamic-shape kernels used from then on."
        },
    )
    validate_only: bool = field(
        default=False,
        metadata={"help": "Only evaluate the init_from_pretrained draft on the validation sets; no training."},
    )
    real_tau_steps: int = field(
        default=0,
        metadata={"help": "Every N steps decode validation prompts speculatively and log the real tau; 0 = off."},
    )
    real_tau_samples: int = field(default=4, metadata={"help": "Validation prompts per set for the real tau."})
    real_tau_max_new_tokens: int = field(default=64, metadata={"help": "Decoded tokens per prompt for the real tau."})

    # --- packed (THD) batches (docs/PACKING.md) -------------------------------------------------
    packing: bool = field(
        default=False,
        metadata={"help": "Pack several conversations into one row per rank (b=1) with per-document positions."},
    )
    packing_max_tokens: int | None = field(
        default=None, metadata={"help": "Token budget of one packed row (audio positions + text); needs packing."}
    )
    anchor_budget: int | None = field(
        default=None,
        metadata={"help": "Packed batches: cap on anchors per micro-batch (num_anchors apply per document)."},
    )

    # --- DFlash2 (docs/ARCHITECTURE.md) --------------------------------------------------------------
    # defaults and help from configuration_dflash.DFlash2Fields (one source)
    conv_kernel_size: int = field(default=_D2.conv_kernel_size, metadata={"help": _D2.help("conv_kernel_size")})
    conv_group_size: int = field(default=_D2.conv_group_size, metadata={"help": _D2.help("conv_group_size")})
    selector_rank: int = field(default=_D2.selector_rank, metadata={"help": _D2.help("selector_rank")})
    selector_top_k: int = field(default=_D2.selector_top_k, metadata={"help": _D2.help("selector_top_k")})
    selector_loss_weight: float = field(
        default=1.0, metadata={"help": "DFlash2: loss = base + selector_loss_weight * selector."}
    )
    use_fused_linear_ce: bool | None = field(
        default=None,
        metadata={"help": "DFlash loss as a fused lm_head+CE (gradient made in the forward, logits never kept; "
                  "default for dflash) or, false, dense per-chunk logits recomputed in backward. DFlash2 needs "
                  "the dense logits (must be false; its default)."},
    )

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

    logging_nan_inf_filter: bool = field(
        default=False,
        metadata={
            "help": "Trainer's filter that hides nan/inf losses from the logged average. Off by default: it reads "
            "every micro-batch's loss on the host, which stalls the GPU between steps; a non-finite loss is then "
            "logged as it is (the step is taken either way)."
        },
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
        self._check_objective()
        if self.target_argmax_chunk_size <= 0:
            raise ValueError(f"target_argmax_chunk_size must be > 0, got {self.target_argmax_chunk_size}")
        if self.attention_backend not in ("auto", "flex", "sdpa"):
            raise ValueError(f"attention_backend must be auto, flex or sdpa, got {self.attention_backend!r}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {self.num_anchors}")
        for name, low in (("real_tau_steps", 0), ("real_tau_samples", 1), ("real_tau_max_new_tokens", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        self._check_packing()
        self._check_dflash2()
        self._check_adaptation()

    def _check_packing(self) -> None:
        if self.packing and (self.packing_max_tokens is None or self.packing_max_tokens < 1):
            raise ValueError(f"packing=true needs packing_max_tokens >= 1 (the token budget of one packed row), "
                             f"got {self.packing_max_tokens}")
        if not self.packing and self.packing_max_tokens is not None:
            raise ValueError("packing_max_tokens is set but packing=false; set packing=true or drop packing_max_tokens")
        if self.anchor_budget is not None:
            if self.anchor_budget < 1:
                raise ValueError(f"anchor_budget must be >= 1 (or unset for no cap), got {self.anchor_budget}")
            if not self.packing:
                raise ValueError("anchor_budget caps anchors of packed (THD) micro-batches; set packing=true, or "
                                 "bound padded batches with num_anchors (up to batch * num_anchors blocks)")

    def _check_objective(self) -> None:
        from .labels import LABEL_SOURCES
        from .losses import LOSSES
        from .objective import fused_ce_conflict

        for name, registry in (("label_source", LABEL_SOURCES), ("loss_type", LOSSES)):
            if getattr(self, name) not in registry:
                raise ValueError(f"{name} must be one of {sorted(registry)}, got {getattr(self, name)!r}")
        if self.label_top_k < 1:
            raise ValueError(f"label_top_k must be >= 1, got {self.label_top_k}")
        if not 0.0 < self.dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha must be in (0, 1], got {self.dpace_alpha}")
        conflict = fused_ce_conflict(self.variant, self.loss_type, self.label_source)
        if self.use_fused_linear_ce is None:
            self.use_fused_linear_ce = conflict is None
        if self.use_fused_linear_ce and conflict:
            raise ValueError(f"use_fused_linear_ce=true: {conflict}; set use_fused_linear_ce=false")

    def _check_dflash2(self) -> None:
        if self.selector_loss_weight < 0:
            raise ValueError(f"selector_loss_weight must be >= 0, got {self.selector_loss_weight}")
        DFlash2Fields.of(self).check()

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
        if self.init_from_pretrained:
            resolve_draft_dir(self.init_from_pretrained)  # a missing draft export fails before the target loads

    @property
    def resolved_export_dir(self) -> str:
        return self.export_dir or f"{self.output_dir}/draft"


@dataclass
class DFlashDataArguments:
    """Where the speech data comes from and how it is batched (parsed beside `DFlashTrainingArguments`)."""

    train_data: list[str] | None = field(
        default=None, metadata={"help": "NeMo manifests (.json/.jsonl[.gz]) or lhotse cut files to train on."}
    )
    train_data_weights: list[float] | None = field(
        default=None, metadata={"help": "Sampling weight per train_data entry (default: all 1)."}
    )
    eval_data: list[str] | None = field(
        default=None,
        metadata={"help": "Validation sets as NAME=PATH (or PATH; the name is the file stem). Each is reported "
                          "as eval_NAME_loss, eval_NAME_tau_est, ..."},
    )
    max_tokens: int = field(
        default=4096, metadata={"help": "Token budget of one batch per rank: batch size x longest (audio + text)."}
    )
    max_batch_size: int | None = field(default=None, metadata={"help": "Optional cap on samples per batch."})
    system_prompt: str | None = field(default=None, metadata={"help": "Optional system turn."})
    prompt: str | None = field(
        default=None, metadata={"help": "User text beside the audio when a cut has no `context` field."}
    )
    padding_side: str | None = field(
        default=None, metadata={"help": "left or right; default: the processor's own padding side."}
    )
    skip_bad_samples: bool = field(
        default=False, metadata={"help": "False: a bad sample is an error. True: skip it, warn with its id, count it."}
    )
    resample_audio: bool = field(
        default=True, metadata={"help": "Resample audio to the processor's rate (False: a mismatch is an error)."}
    )
    num_buckets: int = field(default=10, metadata={"help": "Duration buckets of the dynamic bucketing sampler."})

    def __post_init__(self):
        if self.train_data_weights is not None and len(self.train_data_weights) != len(self.train_data or []):
            raise ValueError(
                f"train_data_weights has {len(self.train_data_weights)} entries for "
                f"{len(self.train_data or [])} train_data paths; give one weight per path"
            )
        if self.padding_side not in (None, "left", "right"):
            raise ValueError(f"padding_side must be left or right, got {self.padding_side!r}")
        for path in (self.train_data or []) + [p.split("=", 1)[-1] for p in self.eval_data or []]:
            if not Path(path).exists():
                raise FileNotFoundError(f"data file {path!r} does not exist (from train_data / eval_data)")

    def train_sources(self) -> list[DataSource] | None:
        from .data import DataSource

        if not self.train_data:
            return None
        weights = self.train_data_weights or [1.0] * len(self.train_data)
        return [DataSource(path=p, weight=w) for p, w in zip(self.train_data, weights)]

    def eval_sources(self) -> dict[str, DataSource] | None:
        from .data import DataSource

        if not self.eval_data:
            return None
        out: dict[str, DataSource] = {}
        for item in self.eval_data:
            name, path = item.split("=", 1) if "=" in item else (Path(item).name.split(".")[0], item)
            if name in out:
                raise ValueError(f"two eval_data sets are named {name!r}; name them explicitly as NAME=PATH")
            out[name] = DataSource(path=path)
        return out

    def conversation(self) -> ConversationConfig:
        from .data import ConversationConfig

        return ConversationConfig(system_prompt=self.system_prompt, prompt=self.prompt)
