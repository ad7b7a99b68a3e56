"""The named configurations (``RunConfig``): target, data and ``dflash-train`` flags of each run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunConfig:
    """A named benchmark configuration: which target, data and dflash-train flags."""

    name: str
    target: str  # "whisper-base" or a TEXT_TARGETS key ("smollm2", "qwen2.5-coder")
    train_flags: list[str]
    eval_max_new_tokens: int = 128
    prompt_lookup: bool = False
    label_max_new_tokens: int = 96
    notes: str = ""
    extra: dict = field(default_factory=dict)
    # Whisper: train on the target's own greedy transcripts (`labels NAME`, data/speech/generated/) with
    # --label_source ground_truth, instead of the flite texts with target_argmax labels
    generated_labels: bool = False


WHISPER_MASK_ID = 50360  # <|startoflm|>: in suppress_tokens, so Whisper never emits it and prompts never hold it
# GPU-sized defaults; append dflash-train flags after `--` to override (the last occurrence of a flag wins).
COMMON_WHISPER = [
    "--mask_token_id",
    str(WHISPER_MASK_ID),
    "--num_draft_layers",
    "2",
    "--num_anchors",
    "128",
    "--max_tokens",
    "4000",
    "--learning_rate",
    "6e-4",
    "--lr_scheduler_type",
    "cosine",
    "--warmup_steps",
    "100",
    "--max_steps",
    "3000",
    "--eval_strategy",
    "steps",
    "--eval_steps",
    "250",
    "--real_tau_steps",
    "500",
    "--real_tau_samples",
    "8",
]
COMMON_WHISPER_CTX = COMMON_WHISPER + ["--draft_encoder_context", "true"]
# Sized for the 2-core CPU (bf16 matmuls are ~4x fp32 there): 1 draft layer, 100 steps of 2048 tokens.
COMMON_SMOL = [
    "--num_draft_layers",
    "1",
    "--num_anchors",
    "64",
    "--max_tokens",
    "2048",
    "--learning_rate",
    "1e-3",
    "--label_source",
    "ground_truth",
    "--lr_scheduler_type",
    "cosine",
    "--warmup_steps",
    "20",
    "--max_steps",
    "100",
    "--eval_strategy",
    "steps",
    "--eval_steps",
    "25",
    "--real_tau_steps",
    "0",
]

# Qwen2.5-Coder-1.5B-Instruct, sized for one large GPU (bf16; 1.78 B target): 2 draft layers, 2000 steps of 16k
# tokens, stopped once the dev tau_est has not risen for two evaluations and exported from the best checkpoint (a
# draft trained on 2000 prompts' responses memorized them: dev tau_est 1.46 at step 250, 1.30 at 500; QUALITY.md).
COMMON_QWEN = [
    "--num_draft_layers",
    "2",
    "--num_anchors",
    "256",
    "--max_tokens",
    "16384",
    "--learning_rate",
    "6e-4",
    "--label_source",
    "ground_truth",
    "--lr_scheduler_type",
    "cosine",
    "--warmup_steps",
    "100",
    "--max_steps",
    "2000",
    "--eval_strategy",
    "steps",
    "--eval_steps",
    "250",
    "--real_tau_steps",
    "0",
    "--load_best_model_at_end",
    "true",
    "--metric_for_best_model",
    "dev_tau_est",
    "--early_stopping_patience",
    "2",
]

CONFIGS = {
    c.name: c
    for c in [
        RunConfig("whisper-dflash-b8", "whisper-base", COMMON_WHISPER + ["--block_size", "8"]),
        RunConfig("whisper-dflash-b16", "whisper-base", COMMON_WHISPER + ["--block_size", "16"]),
        RunConfig("whisper-dflash2-b8", "whisper-base", COMMON_WHISPER + ["--block_size", "8", "--variant", "dflash2"]),
        # The encoder-context opt-in (outside the published contract): the draft also reads the encoder frames.
        RunConfig("whisper-ctx-dflash-b8", "whisper-base", COMMON_WHISPER_CTX + ["--block_size", "8"]),
        RunConfig("whisper-ctx-dflash-b16", "whisper-base", COMMON_WHISPER_CTX + ["--block_size", "16"]),
        RunConfig(
            "whisper-ctx-dflash2-b8", "whisper-base", COMMON_WHISPER_CTX + ["--block_size", "8", "--variant", "dflash2"]
        ),
        # A deeper draft (docs/QUALITY.md: tau stopped rising with 2 layers; the per-slot
        # accuracy is flat over the block, as if the draft's reading of the audio were the limit).
        RunConfig(
            "whisper-ctx-dflash2-b8-l4",
            "whisper-base",
            COMMON_WHISPER_CTX + ["--block_size", "8", "--variant", "dflash2", "--num_draft_layers", "4"],
        ),
        # Taps up to the decoder's last layer (the DESIGN default spreads them over layers 1..L-3: [1, 3] for 2 draft
        # layers of Whisper-base's 6, [1, 2, 2, 3] for 4, so the draft never sees layers 4 and 5).
        RunConfig(
            "whisper-ctx-dflash2-b8-t135",
            "whisper-base",
            COMMON_WHISPER_CTX + ["--block_size", "8", "--variant", "dflash2", "--target_layer_ids", "1", "3", "5"],
        ),
        RunConfig(
            "whisper-ctx-dflash2-b8-l4-t12345",
            "whisper-base",
            COMMON_WHISPER_CTX
            + [
                "--block_size",
                "8",
                "--variant",
                "dflash2",
                "--num_draft_layers",
                "4",
                "--target_layer_ids",
                "1",
                "2",
                "3",
                "4",
                "5",
            ],
        ),
        # Its DFlash twin: the DFlash2 / DFlash tau ratio on the same data, depth and taps.
        RunConfig(
            "whisper-ctx-dflash-b8-l4-t12345",
            "whisper-base",
            COMMON_WHISPER_CTX
            + ["--block_size", "8", "--num_draft_layers", "4", "--target_layer_ids", "1", "2", "3", "4", "5"],
        ),
        # Trained on Whisper's own transcripts (docs/QUALITY.md: the flite texts and Whisper's greedy
        # transcripts differ at 13% of the supervised positions), the published contract's recipe for generated labels.
        *(
            RunConfig(
                f"whisper-gen-ctx-{tag}",
                "whisper-base",
                COMMON_WHISPER_CTX + ["--label_source", "ground_truth", *flags],
                generated_labels=True,
            )
            for tag, flags in (
                ("dflash-b8", ["--block_size", "8"]),
                ("dflash-b16", ["--block_size", "16"]),
                ("dflash2-b8", ["--block_size", "8", "--variant", "dflash2"]),
                # the same run with FP8 draft linears, for the dev tau beside dflash2-b8's
                ("dflash2-b8-fp8", ["--block_size", "8", "--variant", "dflash2", "--float8_draft_linears", "true"]),
            )
        ),
        # Objective comparison at block 8: loss type and label source, else as whisper-ctx-dflash-b8.
        RunConfig(
            "whisper-ctx-dflash-b8-dpace",
            "whisper-base",
            COMMON_WHISPER_CTX + ["--block_size", "8", "--loss_type", "dpace"],
        ),
        RunConfig(
            "whisper-ctx-dflash-b8-softlabels",
            "whisper-base",
            COMMON_WHISPER_CTX + ["--block_size", "8", "--label_source", "target_distribution"],
        ),
        RunConfig(
            "smollm2-dflash-b8",
            "smollm2",
            COMMON_SMOL + ["--block_size", "8"],
            eval_max_new_tokens=64,
            prompt_lookup=True,
            label_max_new_tokens=96,
        ),
        # Objective comparison on the text LLM, on the same generated labels: label source and loss type.
        *(
            RunConfig(
                f"smollm2-dflash-b8-{tag}",
                "smollm2",
                COMMON_SMOL + ["--block_size", "8", *flags],
                eval_max_new_tokens=64,
                label_max_new_tokens=96,
            )
            for tag, flags in (
                ("argmax", ["--label_source", "target_argmax"]),
                ("dpace", ["--loss_type", "dpace"]),
                ("softlabels", ["--label_source", "target_distribution"]),
            )
        ),
        RunConfig(
            "qwencoder-dflash-b8",
            "qwen2.5-coder",
            COMMON_QWEN + ["--block_size", "8"],
            eval_max_new_tokens=128,
            prompt_lookup=True,
            label_max_new_tokens=128,
        ),
    ]
}


def get_config(name: str) -> RunConfig:
    if name not in CONFIGS:
        raise SystemExit(f"unknown configuration {name!r}; choose one of {sorted(CONFIGS)}")
    return CONFIGS[name]


def run_dir(cache: Path, name: str) -> Path:
    return cache / "runs" / name
