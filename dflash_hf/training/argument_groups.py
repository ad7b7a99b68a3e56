"""The `--help` groups of `dflash-train` (light: no torch, no transformers).

The options are the fields of the settings classes (`dflash_hf.settings`: their types, defaults, help and checks):
`DFlashTrainingArguments` (training_args.py) is `TrainingArguments` plus `TRAINING_SETTINGS`, and
`DFlashDataArguments` is `DataSettings`. This module only arranges those fields for `--help`: the main groups first
(model and draft, objective, data, adaptation, packing, run), then the inherited `TrainingArguments` sections (the
light parser, `cli/options.py`), then "DFlash advanced" (tuning knobs whose defaults suit most runs) and "DFlash
experimental" (FP8 matmuls, the Whisper encoder context). Each group is a dataclass made from the settings' own
fields. Every option keeps its flat name in `--config` YAML files, whatever its group.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, field, fields, make_dataclass
from pathlib import Path

from dflash_hf.settings import (
    AdaptationSettings,
    DataSettings,
    DraftSettings,
    ModelSettings,
    ObjectiveSettings,
    RunSettings,
)

ADVANCED_GROUP = "DFlash advanced: tuning knobs (the defaults suit most runs)"
EXPERIMENTAL_GROUP = "DFlash experimental: may change without notice (compare the dev tau with a run without them)"

# (title, ((settings class, field names), ...)) of each group, in `--help` order.
MAIN_LAYOUT = (
    (
        "DFlash model and draft",
        (
            (ModelSettings, ("target_name_or_path", "target_family", "precision")),
            (DraftSettings, ("variant", "num_draft_layers", "target_layer_ids", "mask_token_id")),
            (ModelSettings, ("init_from_pretrained", "export_dir")),
        ),
    ),
    (
        "DFlash objective: blocks, labels and loss",
        (
            (DraftSettings, ("block_size",)),
            (ObjectiveSettings, ("num_anchors", "gamma", "label_source", "loss_type", "selector_loss_weight")),
        ),
    ),
    (
        "DFlash data",
        (
            (
                DataSettings,
                (
                    "train_data",
                    "train_data_weights",
                    "eval_data",
                    "max_tokens",
                    "max_batch_size",
                    "system_prompt",
                    "prompt",
                    "skip_bad_samples",
                ),
            ),
        ),
    ),
    ("DFlash adaptation of a warm-started draft", ((AdaptationSettings, None),)),
    ("DFlash packed batches", ((ObjectiveSettings, ("packing", "packing_max_tokens", "anchor_budget")),)),
    (
        "DFlash run: validation, real tau, compilation",
        (
            (
                RunSettings,
                (
                    "validate_only",
                    "overwrite_output_dir",
                    "eval_real_tau",
                    "real_tau_steps",
                    "max_train_minutes",
                    "early_stopping_patience",
                    "skip_oom_batches",
                    "torch_compile_layers",
                ),
            ),
        ),
    ),
)
LATE_LAYOUT = (
    (
        ADVANCED_GROUP,
        (
            (
                DataSettings,
                (
                    "padding_side",
                    "resample_audio",
                    "num_buckets",
                    "max_chars_per_second",
                    "allow_command_audio_sources",
                    "allow_url_audio_sources",
                ),
            ),
            (ObjectiveSettings, ("label_top_k", "dpace_alpha")),
            (ModelSettings, ("target_strict_load", "trust_remote_code")),
            (RunSettings, ("resume_allow_changes",)),
            (
                ObjectiveSettings,
                (
                    "anchor_pad_multiple",
                    "target_argmax_chunk_size",
                    "attention_backend",
                    "ce_chunk_size",
                    "use_fused_linear_ce",
                ),
            ),
            (DraftSettings, ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")),
            (RunSettings, ("real_tau_samples", "real_tau_max_new_tokens", "early_stopping_threshold")),
            (ModelSettings, ("target_cuda_graph",)),
            (RunSettings, ("compile_draft_layers", "compile_target")),  # deprecated: hidden, still accepted
        ),
    ),
    (
        EXPERIMENTAL_GROUP,
        (
            (DraftSettings, ("draft_encoder_context",)),
            (RunSettings, ("float8_draft_linears",)),
            (ObjectiveSettings, ("float8_lm_head",)),
        ),
    ),
)


def help_group(title: str, parts) -> type:
    """A dataclass for `HfArgumentParser` holding the listed settings fields (all of a class for None), with their
    types, defaults and help, under `title` (its `_argument_group_name`)."""
    specs = []
    for cls, names in parts:
        hints = typing.get_type_hints(cls)
        by_name = {f.name: f for f in fields(cls)}
        for name in names or by_name:
            spec = by_name[name]
            has_factory = spec.default_factory is not MISSING
            kwargs = {"default_factory": spec.default_factory} if has_factory else {"default": spec.default}
            specs.append((name, hints[name], field(metadata=spec.metadata, **kwargs)))
    name = "".join(w.capitalize() for w in title.split(":")[0].split()) + "Options"
    return make_dataclass(name, specs, namespace={"_argument_group_name": title})


HELP_GROUPS = tuple(help_group(title, parts) for title, parts in MAIN_LAYOUT)
LATE_HELP_GROUPS = tuple(help_group(title, parts) for title, parts in LATE_LAYOUT)


def check_data_paths(data_args) -> None:
    """Every train_data / eval_data file exists (the CLI's pre-flight, before anything loads). `data_args`: a
    `DFlashDataArguments` or the light parser's namespace."""
    for path in (data_args.train_data or []) + [p.split("=", 1)[-1] for p in data_args.eval_data or []]:
        if not Path(path).exists():
            raise FileNotFoundError(f"data file {path!r} does not exist (from train_data / eval_data)")


__all__ = ["ADVANCED_GROUP", "EXPERIMENTAL_GROUP", "HELP_GROUPS", "LATE_HELP_GROUPS", "check_data_paths", "help_group"]
