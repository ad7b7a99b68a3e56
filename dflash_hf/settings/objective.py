"""The settings of the training objective (`ObjectiveSettings`): anchors, labels, the loss and how it is computed.
`dflash_hf.objective.DFlashObjective`, its label sources and its losses take every option from here. Light: no
torch, no transformers."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_hf.settings.checks import Range, Settings, count, setting

DEFAULT_NUM_ANCHORS = 512  # anchors per row when `num_anchors` is unset (and no export recorded the run's)
ATTENTION_BACKENDS = ("auto", "flex", "sdpa")


@dataclass
class ObjectiveSettings(Settings):
    """Blocks, labels and the loss of one micro-batch (DFlash2's path selector included). Built standalone,
    `num_anchors` left unset is `DEFAULT_NUM_ANCHORS`; the training arguments resolve it themselves (with
    `validate_only`, from the export's training record)."""

    num_anchors: int | None = setting(
        None,
        f"Anchors (blocks) sampled per row; default {DEFAULT_NUM_ANCHORS}, or with validate_only the training run's "
        "(recorded in the export).",
    )
    gamma: float | None = setting(None, "Slot decay w_k=exp(-(k-1)/gamma), > 0; default 7/5/4 for B=16/10/8.")
    label_source: str = setting(
        "target_argmax",
        "target_argmax (frozen target's greedy next token), ground_truth (data tokens) or "
        "target_distribution (soft labels: the target's top label_top_k probabilities, renormalized).",
    )
    loss_type: str = setting(
        "ce", "ce (slot-decayed cross-entropy) or dpace (D-PACE confidence-derived position weights)."
    )
    selector_loss_weight: float = setting(1.0, "DFlash2: loss = base + selector_loss_weight * selector.")
    packing: bool = setting(
        False, "Pack several conversations into one row per rank (b=1) with per-document positions."
    )
    packing_max_tokens: int | None = setting(
        None, "Token budget of one packed row (audio positions + text); needs packing."
    )
    anchor_budget: int | None = setting(
        None, "Packed batches: cap on anchors per micro-batch (num_anchors apply per document)."
    )
    label_top_k: int = setting(8, "label_source=target_distribution: target tokens kept per position.")
    dpace_alpha: float = setting(0.5, "loss_type=dpace: confidence smoothing alpha in (0, 1] (paper default 0.5).")
    anchor_pad_multiple: int = setting(8, "Round the per-batch anchor count up to this (fewer compiled shapes).")
    target_argmax_chunk_size: int = setting(128, "Supervised positions projected per chunk for target_argmax labels.")
    attention_backend: str = setting(
        "auto", "flex, sdpa (dense mask) or auto (flex on CUDA, sdpa on CPU).", choices=ATTENTION_BACKENDS
    )
    ce_chunk_size: int = setting(2048, "Draft slots projected to the vocabulary per chunk in the loss.")
    use_fused_linear_ce: bool | None = setting(
        None,
        "DFlash loss as a fused lm_head+CE (gradient made in the forward, logits never kept; "
        "default for dflash) or, false, dense per-chunk logits recomputed in backward. DFlash2 needs "
        "the dense logits (must be false; its default).",
    )
    float8_lm_head: bool = setting(
        False,
        "Experimental: in training, run the input-gradient matmul of the fused lm_head + CE in FP8 (e4m3; "
        "the frozen lm_head quantized once, V x H bytes); logits and loss stay in the training precision. DFlash "
        "with use_fused_linear_ce only, vocabulary and hidden size multiples of 16; needs FP8 tensor cores and "
        "precision=bf16 on a GPU. Compare the dev tau with a run without it.",
    )

    RANGES = {
        "num_anchors": count(1),
        "anchor_pad_multiple": count(1),
        "ce_chunk_size": count(1),
        "target_argmax_chunk_size": count(1, phrase="> 0"),
        "label_top_k": count(1),
        "anchor_budget": count(1, " (or unset for no cap)"),
        "gamma": Range(
            low=0,
            low_open=True,
            why=" (slot weights w_k = exp(-(k-1)/gamma))",
            fix="; leave it unset for the recipe default (7/5/4 for block_size 16/10/8)",
        ),
        "dpace_alpha": Range(low=0, high=1, low_open=True),
        "selector_loss_weight": Range(low=0),
    }

    def __post_init__(self) -> None:
        if self.num_anchors is None:
            self.num_anchors = DEFAULT_NUM_ANCHORS
        super().__post_init__()

    @classmethod
    def validate(cls, values) -> None:
        super().validate(values)
        if values.packing and (values.packing_max_tokens is None or values.packing_max_tokens < 1):
            raise ValueError(
                f"packing=true needs packing_max_tokens >= 1 (the token budget of one packed row), "
                f"got {values.packing_max_tokens}"
            )
        if not values.packing and values.packing_max_tokens is not None:
            raise ValueError("packing_max_tokens is set but packing=false; set packing=true or drop packing_max_tokens")
        if values.anchor_budget is not None and not values.packing:
            raise ValueError(
                "anchor_budget caps anchors of packed (THD) micro-batches; set packing=true, or "
                "bound padded batches with num_anchors (up to batch * num_anchors blocks)"
            )


__all__ = ["ATTENTION_BACKENDS", "DEFAULT_NUM_ANCHORS", "ObjectiveSettings"]
