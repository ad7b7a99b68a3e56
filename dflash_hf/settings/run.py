"""The settings of a training run beyond the draft and its objective: adapting a warm-started draft
(`AdaptationSettings`) and the run itself (`RunSettings`: validation-only runs, real tau, stopping, compilation,
resumes, FP8 draft matmuls). Light: no torch, no transformers."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from dflash_hf.settings.checks import UNIT, Range, Settings, count, setting

# Linear layers of the draft that LoRA may target (the last two exist in DFlash2 drafts only).
LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "fc",
    "kernel_projection",
    "hidden_projection",
)
DEFAULT_LORA_TARGETS = LORA_TARGETS[:7]  # the decoder layers' projections
# `--torch_compile_layers` values: whose decoder layers are compiled one by one.
COMPILE_LAYER_CHOICES = ("draft", "target")
# Settings a resume may change deliberately (`--resume_allow_changes`).
RESUME_CHANGES = ("target", "target_layer_ids", "mask_token_id", "block_size", "train_data")
# Old option names (hidden from --help, still accepted with a FutureWarning) -> what to set instead.
DEPRECATED_OPTIONS = {
    "compile_draft_layers": "torch_compile_layers: [draft]",
    "compile_target": "torch_compile_layers: [target]",
}


@dataclass
class AdaptationSettings(Settings):
    """Adapting a warm-started draft (docs/ADAPTATION.md): the tap projection only, or LoRA."""

    projection_only: bool = setting(
        False, "Train only fc.weight (tap projection) of a warm-started draft; needs init_from_pretrained."
    )
    lora_r: int = setting(0, "LoRA rank on the draft (peft); 0 = off. Merged on export.")
    lora_alpha: float = setting(16.0, "LoRA scaling numerator (scale = alpha / r).")
    lora_dropout: float = setting(0.0, "Dropout on the LoRA input.")
    lora_target_modules: list[str] = setting(
        help=f"Draft linear layers that get LoRA adapters; any of {', '.join(LORA_TARGETS)}.",
        factory=lambda: list(DEFAULT_LORA_TARGETS),
    )

    RANGES = {"lora_r": count(0, " (0 = LoRA off)"), "lora_alpha": Range(low=0, low_open=True), "lora_dropout": UNIT}


@dataclass
class RunSettings(Settings):
    """Validation-only runs, the real-tau callback, stopping, out-of-memory steps, compilation, resumes and the
    experimental FP8 draft matmuls."""

    validate_only: bool = setting(
        False, "Only evaluate the init_from_pretrained draft on the validation sets; no training."
    )
    overwrite_output_dir: bool = setting(
        False,
        "Start a new run in an output_dir (or export_dir) that holds another run's checkpoints or "
        "export: they are removed first. Without it such a directory is refused (resume the run there with "
        "--resume_from_checkpoint true, or choose a new directory).",
    )
    eval_real_tau: bool = setting(
        True,
        "In every evaluation also decode the first real_tau_samples prompts of each validation set "
        "speculatively and report the real acceptance length, eval_<set>_tau (the estimate that predicts "
        "decoding whatever the set's text is: pick drafts by it, --metric_for_best_model dev_tau).",
    )
    real_tau_steps: int = setting(
        0, "Every N steps decode validation prompts speculatively and log the real tau; 0 = off."
    )
    max_train_minutes: float | None = setting(
        None,
        "Stop training after this many minutes of this process's training loop (checked after "
        "each optimizer step; under DDP the ranks' agreed verdict is read one step later), then save a "
        "checkpoint (unless save_strategy is 'no') and export as at max_steps. The schedule still follows "
        "max_steps. None = no limit.",
    )
    early_stopping_patience: int | None = setting(
        None,
        "Stop training once --metric_for_best_model (e.g. dev_tau_est) has not improved for this "
        "many evaluations; with --load_best_model_at_end true the best checkpoint's draft is exported. "
        "None = off.",
    )
    skip_oom_batches: int = setting(
        0,
        "Skip up to this many optimizer steps whose micro-batch runs out of GPU memory (its gradients "
        "dropped, no optimizer update; each logged, counted as skipped_oom_batches and recorded in the "
        "checkpoints); one more stops the run with a message naming the micro-batch and the options that lower "
        'memory. 0: the first stops it. One process only (docs/RELIABILITY.md, "Environment faults").',
    )
    torch_compile_layers: list[str] = setting(
        help="torch.compile each decoder layer of these models apart, on CUDA (TrainingArguments' "
        "--torch_compile compiles the whole draft module at once instead): draft (docs/PERFORMANCE.md: "
        "speech-like draft side 269.6 -> 211.3 ms on an H200; a second batch shape compiles dynamic-shape "
        "kernels used from then on) and/or target (the frozen decoder layers' forward, dynamic shapes; the "
        "tap hooks stay outside the compiled code, so taps and target_argmax labels are the eager target's; "
        "the audio encoder stays eager; the first step compiles for tens of seconds). Default: none.",
        choices=COMPILE_LAYER_CHOICES,
        factory=list,
    )
    resume_allow_changes: list[str] = setting(
        help="Settings a resume may change deliberately (default none: a resume whose checkpoint was trained "
        "with another value is refused, naming each difference). Recorded in the checkpoints and the export.",
        choices=RESUME_CHANGES,
        factory=list,
    )
    real_tau_samples: int = setting(8, "Validation prompts per set for the real tau.")
    real_tau_max_new_tokens: int = setting(64, "Decoded tokens per prompt for the real tau.")
    early_stopping_threshold: float = setting(
        0.0, "How much the metric must improve to count as better (early stopping)."
    )
    float8_draft_linears: bool = setting(
        False,
        "Experimental: in training, run the forward and input-gradient matmuls of the draft's decoder "
        "projections and fc in FP8 (e4m3, scaled per row; dflash_hf/ops/float8.py). Weights, weight gradients, "
        "optimizer, validation, export and decoding keep the training precision. Needs FP8 tensor cores "
        "(compute capability >= 8.9). It changes the numbers: compare the dev tau with a run without it.",
    )
    compile_draft_layers: bool = setting(False, argparse.SUPPRESS)  # deprecated: DEPRECATED_OPTIONS
    compile_target: bool = setting(False, argparse.SUPPRESS)  # deprecated: DEPRECATED_OPTIONS

    RANGES = {
        "real_tau_steps": count(0, " (0: off)"),
        "real_tau_samples": count(1),
        "real_tau_max_new_tokens": count(1),
        "early_stopping_patience": count(1, " (evaluations, or unset)"),
        "skip_oom_batches": count(0, " (0: a step out of GPU memory stops the run)"),
        "early_stopping_threshold": Range(low=0),
        "max_train_minutes": Range(low=0, low_open=True, phrase="a positive number of minutes (or unset)"),
    }


def deprecated_options(values) -> dict[str, str]:
    """name -> replacement of each deprecated option set (to a non-default value) on `values`."""
    defaults = {f.name: f.default for f in fields(RunSettings)}
    return {
        name: replacement
        for name, replacement in DEPRECATED_OPTIONS.items()
        if getattr(values, name, defaults[name]) != defaults[name]
    }


__all__ = [
    "COMPILE_LAYER_CHOICES",
    "DEFAULT_LORA_TARGETS",
    "DEPRECATED_OPTIONS",
    "LORA_TARGETS",
    "RESUME_CHANGES",
    "AdaptationSettings",
    "RunSettings",
    "deprecated_options",
]
