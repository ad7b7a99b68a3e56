"""The DFlash argument groups of `dflash-train` (light: no torch, no transformers).

Each group is a plain dataclass whose fields `HfArgumentParser` turns into options. `dflash-train --help` lists
the main groups first (model and draft, objective, data, adaptation, packing, run), then the inherited
`TrainingArguments` sections, then "DFlash advanced" (tuning knobs whose defaults suit most runs) and
"DFlash experimental" (FP8 matmuls, the Whisper encoder context). `DFlashTrainingArguments` (training_args.py)
combines the training groups with `TrainingArguments`, so one object carries every setting (`args.block_size`,
`args.learning_rate`, ...) and checks them together; `DFlashDataArguments` (sources and data tuning) is parsed
beside it. Every option keeps its flat name in `--config` YAML files, whatever its group.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_hf.training.numeric_options import DATA_RANGES, check_ranges

if TYPE_CHECKING:  # lhotse is imported only when speech data is used
    from dflash_hf.data import ConversationConfig, DataSource

# Mirrors of configuration_dflash constants (DFLASH_VARIANTS, MAX_BLOCK_SIZE, DEFAULT_BLOCK_SIZE and the DFlash2Fields
# defaults below) (a remote-code file, which cannot import this module);
# tests/cli/test_cli.py checks that they agree.
DFLASH_VARIANTS = ("dflash", "dflash2")
MAX_BLOCK_SIZE = 128
DEFAULT_BLOCK_SIZE = 16
DEFAULT_NUM_ANCHORS = 512
DEFAULT_NUM_DRAFT_LAYERS = 5
DEFAULT_MAX_CHARS_PER_SECOND = 50.0  # mirror of dflash_hf.data.sample_checks's (lhotse is imported there)
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
# `--torch_compile_layers` values: whose decoder layers are compiled one by one.
COMPILE_LAYER_CHOICES = ("draft", "target")
ADVANCED_GROUP = "DFlash advanced: tuning knobs (the defaults suit most runs)"
EXPERIMENTAL_GROUP = "DFlash experimental: may change without notice (compare the dev tau with a run without them)"
# Old option names (hidden from --help, still accepted with a FutureWarning) -> what to set instead.
DEPRECATED_OPTIONS = {
    "compile_draft_layers": "torch_compile_layers: [draft]",
    "compile_target": "torch_compile_layers: [target]",
}
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# TrainingArguments fields whose DFlash default or meaning differs: (default, help).
TRAINER_OVERRIDES = {
    "learning_rate": (6e-4, "AdamW learning rate (DFlash default 6e-4)."),
    "lr_scheduler_type": ("constant", "LR schedule (default constant)."),
    "weight_decay": (0.0, "AdamW weight decay."),
    "remove_unused_columns": (False, "Kept False: DFlash batches carry audio and loss-mask keys."),
    "save_safetensors": (True, "Checkpoints in safetensors."),
    "logging_nan_inf_filter": (
        False,
        "Trainer's filter that hides nan/inf losses from the logged average. Off by default: it reads every "
        "micro-batch's loss on the host, which stalls the GPU between steps; a non-finite loss is then logged as "
        "it is (the step is taken either way).",
    ),
    "push_to_hub": (
        False,
        "Publish the exported draft (serving files and a generated model card) to --hub_model_id at the end of "
        "training. Checkpoints are not uploaded.",
    ),
    "hub_model_id": (None, "Hub repo (org/name) that --push_to_hub publishes the exported draft to."),
    "ddp_find_unused_parameters": (
        False,
        "DDP: search for parameters without gradient every step. False: every trainable draft parameter takes part "
        "in every step's loss (also on a rank without valid anchors).",
    ),
    "resume_from_checkpoint": (
        None,
        "Resume training from this complete checkpoint-N directory, or true: from the last complete checkpoint in "
        "output_dir (incomplete ones, from interrupted saves, are skipped), or auto: as true when there is one, else "
        "start the run (a job script that is requeued after preemption).",
    ),
}


@dataclass
class DFlashModelArguments:
    """The frozen target and the draft trained against it."""

    _argument_group_name = "DFlash model and draft"

    target_name_or_path: str | None = field(
        default=None, metadata={"help": "Local directory (or cached hub id) of the frozen target."}
    )
    target_family: str | None = field(
        default=None,
        metadata={
            "help": "Target family row (docs/DATA.md); default from the config's model_type. "
            "qwen2_audio_single_placeholder selects the model-side audio expansion (NeMo SALM layout)."
        },
    )
    precision: str = field(
        default="fp32",
        metadata={"help": "Parameter dtype of target AND draft (no autocast).", "choices": ("fp32", "bf16")},
    )
    variant: str = field(default="dflash", metadata={"help": "dflash or dflash2.", "choices": DFLASH_VARIANTS})
    num_draft_layers: int = field(
        default=DEFAULT_NUM_DRAFT_LAYERS,
        metadata={"help": "Decoder layers of a new draft (a warm start keeps the export's)."},
    )
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "0-based target decoder layers to tap, each once; default spreads 1..L-3."}
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


@dataclass
class DFlashObjectiveArguments:
    """Blocks, labels and the loss (DFlash2's path selector included)."""

    _argument_group_name = "DFlash objective: blocks, labels and loss"

    block_size: int | None = field(
        default=None,
        metadata={
            "help": f"Draft slots per anchor (anchor + B-1 predictions), 2..{MAX_BLOCK_SIZE}; default "
            f"{DEFAULT_BLOCK_SIZE}, or the init_from_pretrained export's block size."
        },
    )
    num_anchors: int | None = field(
        default=None,
        metadata={
            "help": f"Anchors (blocks) sampled per row; default {DEFAULT_NUM_ANCHORS}, or with validate_only the "
            "training run's (recorded in the export's dflash_config)."
        },
    )
    gamma: float | None = field(
        default=None, metadata={"help": "Slot decay w_k=exp(-(k-1)/gamma), > 0; default 7/5/4 for B=16/10/8."}
    )
    label_source: str = field(
        default="target_argmax",
        metadata={
            "help": "target_argmax (frozen target's greedy next token), ground_truth (data tokens) or "
            "target_distribution (soft labels: the target's top label_top_k probabilities, renormalized)."
        },
    )
    loss_type: str = field(
        default="ce",
        metadata={"help": "ce (slot-decayed cross-entropy) or dpace (D-PACE confidence-derived position weights)."},
    )
    selector_loss_weight: float = field(
        default=1.0, metadata={"help": "DFlash2: loss = base + selector_loss_weight * selector."}
    )


@dataclass
class DFlashAdaptationArguments:
    """Adapting a warm-started draft (docs/ADAPTATION.md)."""

    _argument_group_name = "DFlash adaptation of a warm-started draft"

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


@dataclass
class DFlashPackingArguments:
    """Packed (THD) batches (docs/PACKING.md)."""

    _argument_group_name = "DFlash packed batches"

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


@dataclass
class DFlashRunArguments:
    """Validation-only runs, the real-tau callback, compilation."""

    _argument_group_name = "DFlash run: validation, real tau, compilation"

    validate_only: bool = field(
        default=False,
        metadata={"help": "Only evaluate the init_from_pretrained draft on the validation sets; no training."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start a new run in an output_dir (or export_dir) that holds another run's checkpoints or "
            "export: they are removed first. Without it such a directory is refused (resume the run there with "
            "--resume_from_checkpoint true, or choose a new directory)."
        },
    )
    eval_real_tau: bool = field(
        default=True,
        metadata={
            "help": "In every evaluation also decode the first real_tau_samples prompts of each validation set "
            "speculatively and report the real acceptance length, eval_<set>_tau (the estimate that predicts "
            "decoding whatever the set's text is: pick drafts by it, --metric_for_best_model dev_tau)."
        },
    )
    real_tau_steps: int = field(
        default=0,
        metadata={"help": "Every N steps decode validation prompts speculatively and log the real tau; 0 = off."},
    )
    max_train_minutes: float | None = field(
        default=None,
        metadata={
            "help": "Stop training after this many minutes of this process's training loop (checked after "
            "each optimizer step; under DDP the ranks' agreed verdict is read one step later), then save a "
            "checkpoint (unless save_strategy is 'no') and export as at max_steps. The schedule still follows "
            "max_steps. None = no limit."
        },
    )
    early_stopping_patience: int | None = field(
        default=None,
        metadata={
            "help": "Stop training once --metric_for_best_model (e.g. dev_tau_est) has not improved for this "
            "many evaluations; with --load_best_model_at_end true the best checkpoint's draft is exported. "
            "None = off."
        },
    )
    skip_oom_batches: int = field(
        default=0,
        metadata={
            "help": "Skip up to this many optimizer steps whose micro-batch runs out of GPU memory (its gradients "
            "dropped, no optimizer update; each logged, counted as skipped_oom_batches and recorded in the "
            "checkpoints); one more stops the run with a message naming the micro-batch and the options that lower "
            'memory. 0: the first stops it. One process only (docs/RELIABILITY.md, "Environment faults").'
        },
    )
    torch_compile_layers: list[str] = field(
        default_factory=list,
        metadata={
            "help": "torch.compile each decoder layer of these models apart, on CUDA (TrainingArguments' "
            "--torch_compile compiles the whole draft module at once instead): draft (docs/PERFORMANCE.md: "
            "speech-like draft side 269.6 -> 211.3 ms on an H200; a second batch shape compiles dynamic-shape "
            "kernels used from then on) and/or target (the frozen decoder layers' forward, dynamic shapes; the "
            "tap hooks stay outside the compiled code, so taps and target_argmax labels are the eager target's; "
            "the audio encoder stays eager; the first step compiles for tens of seconds). Default: none.",
            "choices": COMPILE_LAYER_CHOICES,
        },
    )


@dataclass
class DFlashTuningArguments:
    """Tuning knobs of the training run whose defaults suit most runs (`--help` lists them after the
    TrainingArguments sections, as "DFlash advanced")."""

    _argument_group_name = ADVANCED_GROUP

    label_top_k: int = field(
        default=8, metadata={"help": "label_source=target_distribution: target tokens kept per position."}
    )
    dpace_alpha: float = field(
        default=0.5, metadata={"help": "loss_type=dpace: confidence smoothing alpha in (0, 1] (paper default 0.5)."}
    )
    target_strict_load: bool = field(
        default=True,
        metadata={"help": "Require every target parameter in its checkpoint. False = intentional partial init."},
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Load a target whose config.json has an auto_map (its own modeling code, run in this process). "
            "Off: such a target is refused. Set it only for a target directory whose code you trust."
        },
    )
    resume_allow_changes: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Settings a resume may change deliberately (default none: a resume whose checkpoint was trained "
            "with another value is refused, naming each difference). Recorded in the checkpoints and the export.",
            "choices": ("target", "target_layer_ids", "mask_token_id", "block_size", "train_data"),
        },
    )
    anchor_pad_multiple: int = field(
        default=8, metadata={"help": "Round the per-batch anchor count up to this (fewer compiled shapes)."}
    )
    target_argmax_chunk_size: int = field(
        default=128, metadata={"help": "Supervised positions projected per chunk for target_argmax labels."}
    )
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "flex, sdpa (dense mask) or auto (flex on CUDA, sdpa on CPU).",
            "choices": ("auto", "flex", "sdpa"),
        },
    )
    ce_chunk_size: int = field(
        default=2048, metadata={"help": "Draft slots projected to the vocabulary per chunk in the loss."}
    )
    use_fused_linear_ce: bool | None = field(
        default=None,
        metadata={
            "help": "DFlash loss as a fused lm_head+CE (gradient made in the forward, logits never kept; "
            "default for dflash) or, false, dense per-chunk logits recomputed in backward. DFlash2 needs "
            "the dense logits (must be false; its default)."
        },
    )
    conv_kernel_size: int = field(default=2, metadata={"help": "DFlash2: taps of the dynamic convolutions."})
    conv_group_size: int = field(
        default=16, metadata={"help": "DFlash2: channels sharing one dynamic coefficient (divides hidden size)."}
    )
    selector_rank: int = field(default=256, metadata={"help": "DFlash2: rank of the path selector codebooks."})
    selector_top_k: int = field(default=16, metadata={"help": "DFlash2: candidates per slot of the path selector."})
    real_tau_samples: int = field(default=8, metadata={"help": "Validation prompts per set for the real tau."})
    real_tau_max_new_tokens: int = field(default=64, metadata={"help": "Decoded tokens per prompt for the real tau."})
    early_stopping_threshold: float = field(
        default=0.0, metadata={"help": "How much the metric must improve to count as better (early stopping)."}
    )
    target_cuda_graph: bool | None = field(
        default=None,
        metadata={
            "help": "Replay the frozen target's training forward as a CUDA graph for batch shapes seen before "
            "(the same kernels, none of the host work; docs/PERFORMANCE.md). Unset: on a GPU where the target "
            "can be captured (text and Whisper families, sdpa decoders with full attention), falling back to the "
            "eager forward with a warning if a capture fails; true: always (refused where it cannot run); false: "
            "never. The graphs keep one forward's intermediates and each kept shape's taps allocated (up to a "
            "few GiB): set false when memory is tight."
        },
    )
    compile_draft_layers: bool = field(
        default=False,
        metadata={"help": argparse.SUPPRESS},  # deprecated: DEPRECATED_OPTIONS
    )
    compile_target: bool = field(
        default=False,
        metadata={"help": argparse.SUPPRESS},  # deprecated: DEPRECATED_OPTIONS
    )


@dataclass
class DFlashExperimentalArguments:
    """Experimental features: outside the tested defaults and the published DFlash contract; their behaviour or
    names may change. Compare the dev tau with a run without them."""

    _argument_group_name = EXPERIMENTAL_GROUP

    draft_encoder_context: bool = field(
        default=False,
        metadata={
            "help": "Encoder-decoder targets (Whisper) only, OUTSIDE the published DFlash contract (engines "
            "implementing it cannot serve the draft): each draft layer also cross-attends to the target's "
            "encoder frames, initialized from the cross-attention of the target's top decoder layers. "
            "docs/QUALITY.md measures what it buys."
        },
    )
    float8_draft_linears: bool = field(
        default=False,
        metadata={
            "help": "Experimental: in training, run the forward and input-gradient matmuls of the draft's decoder "
            "projections and fc in FP8 (e4m3, scaled per row; dflash_hf/ops/float8.py). Weights, weight gradients, "
            "optimizer, validation, export and decoding keep the training precision. Needs FP8 tensor cores "
            "(compute capability >= 8.9). It changes the numbers: compare the dev tau with a run without it."
        },
    )
    float8_lm_head: bool = field(
        default=False,
        metadata={
            "help": "Experimental: in training, run the input-gradient matmul of the fused lm_head + CE in FP8 (e4m3; "
            "the frozen lm_head quantized once, V x H bytes); logits and loss stay in the training precision. DFlash "
            "with use_fused_linear_ce only, vocabulary and hidden size multiples of 16; needs FP8 tensor cores and "
            "precision=bf16 on a GPU. Compare the dev tau with a run without it."
        },
    )


@dataclass
class DFlashDataTuningArguments:
    """Tuning knobs and trust policy of the data (listed with "DFlash advanced" in `--help`)."""

    _argument_group_name = ADVANCED_GROUP

    padding_side: str | None = field(
        default=None, metadata={"help": "left or right; default: the processor's own padding side."}
    )
    resample_audio: bool = field(
        default=True, metadata={"help": "Resample audio to the processor's rate (False: a mismatch is an error)."}
    )
    num_buckets: int = field(default=10, metadata={"help": "Duration buckets of the dynamic bucketing sampler."})
    max_chars_per_second: float = field(
        default=DEFAULT_MAX_CHARS_PER_SECOND,
        metadata={
            "help": "A row whose response has more characters per second of its audio than this is a bad sample "
            "(a wrong duration, or a transcript of other audio; speech reaches about 20). Audio under 0.5 s counts "
            "as 0.5 s. Raise it for responses that are not transcripts; 0 turns the check off."
        },
    )
    allow_command_audio_sources: bool = field(
        default=False,
        metadata={
            "help": "Allow lhotse cuts whose audio source is of type 'command' (lhotse runs that command in a "
            "shell to read the audio), and decoder programs (ffmpeg through audioread) for audio files libsndfile "
            "cannot read. Only for data you trust (default: refused; audio is read in-process)."
        },
    )
    allow_url_audio_sources: bool = field(
        default=False,
        metadata={
            "help": "Allow lhotse cuts whose audio source is of type 'url': the audio is downloaded from that "
            "address while training. Only for cut files you trust (default: refused)."
        },
    )


@dataclass
class DFlashDataSourceArguments:
    """Where the speech data comes from and how it is batched."""

    _argument_group_name = "DFlash data"

    train_data: list[str] | None = field(
        default=None, metadata={"help": "NeMo manifests (.json/.jsonl[.gz]) or lhotse cut files to train on."}
    )
    train_data_weights: list[float] | None = field(
        default=None, metadata={"help": "Sampling weight per train_data entry (default: all 1)."}
    )
    eval_data: list[str] | None = field(
        default=None,
        metadata={
            "help": "Validation sets as NAME=PATH (or PATH; the name is the file stem). Each is reported "
            "as eval_NAME_loss, eval_NAME_tau_est, ..."
        },
    )
    max_tokens: int = field(
        default=4096, metadata={"help": "Token budget of one batch per rank: batch size x longest (audio + text)."}
    )
    max_batch_size: int | None = field(default=None, metadata={"help": "Optional cap on samples per batch."})
    system_prompt: str | None = field(default=None, metadata={"help": "Optional system turn."})
    prompt: str | None = field(
        default=None, metadata={"help": "User text beside the audio when a cut has no `context` field."}
    )
    skip_bad_samples: bool = field(
        default=False, metadata={"help": "False: a bad sample is an error. True: skip it, warn with its id, count it."}
    )


@dataclass
class DFlashDataArguments(DFlashDataTuningArguments, DFlashDataSourceArguments):
    """The data options, parsed beside `DFlashTrainingArguments`: the sources (`DFlashDataSourceArguments`) and
    their tuning knobs (`DFlashDataTuningArguments`). Paths are checked by `check_data_paths` (the CLI's pre-flight),
    not here."""

    _argument_group_name = "DFlash data"

    def __post_init__(self):
        check_ranges(self, DATA_RANGES)
        if self.train_data_weights is not None and len(self.train_data_weights) != len(self.train_data or []):
            raise ValueError(
                f"train_data_weights has {len(self.train_data_weights)} entries for "
                f"{len(self.train_data or [])} train_data paths; give one weight per path"
            )
        if self.padding_side not in (None, "left", "right"):
            raise ValueError(f"padding_side must be left or right, got {self.padding_side!r}")

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


def check_data_paths(data_args) -> None:
    """Every train_data / eval_data file exists (the CLI's pre-flight, before anything loads). `data_args`: a
    `DFlashDataArguments` or the light parser's namespace."""
    for path in (data_args.train_data or []) + [p.split("=", 1)[-1] for p in data_args.eval_data or []]:
        if not Path(path).exists():
            raise FileNotFoundError(f"data file {path!r} does not exist (from train_data / eval_data)")


@dataclass
class DFlashAdvancedArguments(DFlashTuningArguments, DFlashDataTuningArguments):
    """`--help`'s "DFlash advanced" group: the training and data tuning knobs together (help only: the real parser
    has them in `DFlashTrainingArguments` and `DFlashDataArguments`)."""

    _argument_group_name = ADVANCED_GROUP


# `dflash-train --help` order: the main DFlash groups, the TrainingArguments sections, then the advanced and the
# experimental groups.
HELP_GROUPS = (
    DFlashModelArguments,
    DFlashObjectiveArguments,
    DFlashDataSourceArguments,
    DFlashAdaptationArguments,
    DFlashPackingArguments,
    DFlashRunArguments,
)
LATE_HELP_GROUPS = (DFlashAdvancedArguments, DFlashExperimentalArguments)


def deprecated_options(args) -> dict[str, str]:
    """name -> replacement of each deprecated option set (to a non-default value) on `args`."""
    defaults = {f.name: f.default for f in fields(DFlashTuningArguments)}
    return {
        name: replacement
        for name, replacement in DEPRECATED_OPTIONS.items()
        if getattr(args, name, defaults[name]) != defaults[name]
    }
