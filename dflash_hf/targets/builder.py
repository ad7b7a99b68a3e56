"""The frozen target and its draft, built and checked in one pass: `build_target_and_draft`.

In order, once each: the target loaded (from a directory, or an HF model as given) and its family resolved
(`FrozenTarget`); its parameters in the run's precision, its decoder layers compiled (`torch_compile_layers: [target]`,
CUDA), its CUDA-graph forwards (`target_cuda_graph`) and the packing check; then the draft: a draft given as it is, a
warm start (`init_from_pretrained`) checked against the settings, or a new one sized from the target's decoder (the
mask id and taps checked first, the encoder width of the encoder-context opt-in, its cross-attention initialized from
the target's); last, the draft checked against the target (`draft_checks.check_draft`: mask id, taps, hidden size,
special ids, encoder width) and cast to the run's precision. Training (`training.assembly`) then adds what only
training needs (seeding, LoRA or projection-only adaptation, FP8 linears).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import nn

from dflash_hf.models.configuration_dflash import DFlash2Fields, DFlashConfig
from dflash_hf.models.modeling_dflash import DFlash2DraftModel, DFlashDraftModel
from dflash_hf.models.modeling_dflash_encoder import copy_cross_attention
from dflash_hf.settings import DEFAULT_NUM_DRAFT_LAYERS
from dflash_hf.targets.draft_checks import (
    WARM_START,
    check_draft,
    check_warm_start,
    check_warm_start_sizes,
    require_encoder,
)
from dflash_hf.targets.families.base import get_tokenizer
from dflash_hf.targets.families.qwen3_asr import warn_missing_vllm_serving_fields
from dflash_hf.targets.forward_graph import forward_graphs
from dflash_hf.targets.frozen import FrozenTarget, TargetModel, load_target, resolve_dtype
from dflash_hf.targets.mask_token import mask_token_candidates, missing_mask_token_message

logger = logging.getLogger(__name__)


class TargetSettings(Protocol):
    """What loading and preparing the frozen target reads (`ModelSettings` fields, and `packing` and
    `torch_compile_layers` of the run; `DFlashTrainingArguments` has them all)."""

    target_family: str | None
    precision: str
    target_strict_load: bool
    trust_remote_code: bool
    target_cuda_graph: bool | None
    packing: bool
    torch_compile_layers: list[str]


class TargetDraftSettings(TargetSettings, Protocol):
    """What `build_target_and_draft` reads: `TargetSettings`, the warm-start export's name and the `DraftSettings`
    fields."""

    init_from_pretrained: str | None
    variant: str
    num_draft_layers: int
    target_layer_ids: list[int] | None
    mask_token_id: int | None
    block_size: int | None
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    draft_encoder_context: bool


class TargetAndDraft(NamedTuple):
    """A frozen target and a draft checked against it."""

    target: FrozenTarget
    draft: nn.Module


def draft_class_for(config: DFlashConfig) -> type[DFlashDraftModel]:
    """`DFlashDraftModel` or `DFlash2DraftModel`, from `config.architectures`."""
    return DFlash2DraftModel if config.variant == "dflash2" else DFlashDraftModel


def load_frozen_target(target: str | TargetModel, settings: TargetSettings) -> FrozenTarget:
    """`target` as a `FrozenTarget`: a directory (or cached hub id) loaded in `settings.precision` (`load_target`),
    an HF model wrapped, its family `settings.target_family` or the config's; a `FrozenTarget` as it is. A loaded
    Qwen3-ASR config without the fields vLLM reads is warned about (`warn_missing_vllm_serving_fields`)."""
    if not isinstance(target, str):
        return FrozenTarget.of(target, settings.target_family)
    model = load_target(
        target, settings.precision, settings.target_strict_load, trust_remote_code=settings.trust_remote_code
    )
    frozen = FrozenTarget(model, settings.target_family)
    warn_missing_vllm_serving_fields(model.config, target)
    return frozen


def prepare_target(target: FrozenTarget, settings: TargetSettings, device: torch.device) -> FrozenTarget:
    """The frozen target in the run's precision, its decoder layers compiled (`torch_compile_layers: [target]`, on
    CUDA), its CUDA-graph forwards for `device` (`target_cuda_graph`) and, with `packing`, checked for packed
    batches: all before any draft is built."""
    target.model.to(resolve_dtype(settings.precision))
    if "target" in settings.torch_compile_layers and device.type == "cuda":
        compile_target_layers(target)
    target.forward_graphs = forward_graphs(settings.target_cuda_graph, target, device)
    if settings.packing:
        target.check_packing()
    return target


def compile_target_layers(target: FrozenTarget) -> None:
    """`torch.compile` the forward of each frozen decoder layer in place (`torch_compile_layers: [target]`), with
    dynamic shapes (new sequence lengths and batch sizes reuse the kernels). Only `forward` is compiled: the module
    call, and with it the tap hooks of `FrozenTarget.capture`, stays eager, so taps are captured exactly as from the
    eager target.
    Idempotent (a target shared by two trainers is compiled once)."""
    for layer in target.layers:
        if not getattr(layer, "_dflash_compiled_forward", False):
            layer.forward = torch.compile(layer.forward, dynamic=True)
            layer._dflash_compiled_forward = True


def build_target_and_draft(
    target: str | TargetModel,
    settings: TargetDraftSettings,
    *,
    draft: nn.Module | None = None,
    warm_start: Callable[[], DFlashDraftModel] | None = None,
    device: torch.device | None = None,
    processor=None,
) -> TargetAndDraft:
    """The frozen target and its draft, checked against each other (see the module docstring).

    `target`: a directory, an HF model or a `FrozenTarget`. The draft is `draft` as given (checked, not cast), else
    the one `warm_start()` loads (the `init_from_pretrained` export, `export.load_draft_strict`; called once the
    target is ready, and checked against the settings), else a new one from `settings` (its initial weights follow
    the torch seed: seed before calling). `device`: where the run computes (default the target's; compilation and
    CUDA graphs only on CUDA). `processor`: the target's processor or tokenizer, for the mask-token candidates named
    when no `mask_token_id` is set."""
    target = load_frozen_target(target, settings)
    prepare_target(target, settings, device if device is not None else target.device)
    if draft is not None:
        check_draft(target, draft.config)
        return TargetAndDraft(target, draft)
    if warm_start is not None:
        draft, source = warm_start(), f"{WARM_START} export"
        check_warm_start_settings(draft.config, settings, target)
    else:
        tokenizer = None if processor is None else get_tokenizer(processor)
        draft, source = new_draft(target, settings, tokenizer), "draft"
    check_draft(target, draft.config, source)
    return TargetAndDraft(target, draft.to(resolve_dtype(settings.precision)))


def check_warm_start_settings(config: DFlashConfig, settings: TargetDraftSettings, target: FrozenTarget) -> None:
    """A warm start keeps the export's architecture, taps, mask id, encoder context and sizes: settings that ask for
    others are refused (`check_warm_start`, `check_warm_start_sizes`), as is an export of another vocabulary."""
    check_warm_start(
        config,
        variant=settings.variant,
        target_layer_ids=settings.target_layer_ids,
        mask_token_id=settings.mask_token_id,
        vocab_size=target.vocab_size,
    )
    if settings.draft_encoder_context and not config.encoder_context:
        raise ValueError(
            f"field 'draft_encoder_context': the {WARM_START} export {settings.init_from_pretrained} has no encoder "
            "context, and a warm start keeps the export's layers; drop the flag or train a fresh draft with it"
        )
    given = {"num_draft_layers": settings.num_draft_layers, **DFlash2Fields.of(settings).as_dict()}
    defaults = {"num_draft_layers": DEFAULT_NUM_DRAFT_LAYERS, **DFlash2Fields().as_dict()}
    check_warm_start_sizes(config, given, defaults)


def new_draft(target: FrozenTarget, settings: TargetDraftSettings, tokenizer=None) -> DFlashDraftModel:
    """A fresh draft sized from the target's decoder: the mask id and the taps asked for are checked against the
    target first (no `mask_token_id`: the error lists candidates, with `tokenizer`), then the config and the model,
    whose encoder cross-attention (`draft_encoder_context`) starts from the target's."""
    if settings.mask_token_id is None and tokenizer is not None:
        candidates = mask_token_candidates(
            tokenizer,
            target.vocab_size,
            target_config=target.model.config,
            extra_ids=target.mask_token_candidates(tokenizer),
        )
        raise ValueError(missing_mask_token_message(candidates))
    target.validate(mask_token_id=settings.mask_token_id, target_layer_ids=settings.target_layer_ids)
    asked = "a new draft was asked to attend to encoder frames"
    width = require_encoder(target, asked) if settings.draft_encoder_context else None
    config = DFlashConfig.from_target_config(
        target.text_config,
        mask_token_id=settings.mask_token_id,
        variant=settings.variant,
        num_hidden_layers=settings.num_draft_layers,
        block_size=settings.block_size,
        target_layer_ids=settings.target_layer_ids,
        encoder_hidden_size=width,
        **DFlash2Fields.of(settings).as_dict(),
    )
    config.vocab_size = target.vocab_size
    draft = draft_class_for(config)(config)
    if config.encoder_context:
        init_encoder_context(draft, target)
    return draft


def init_encoder_context(draft: DFlashDraftModel, target: FrozenTarget) -> None:
    """Each draft layer's encoder cross-attention from the target's top decoder layers' (draft layer i from target
    layer L - n + i), so a fresh draft starts reading the audio as the target's own decoder does."""
    n, total = len(draft.layers), len(target.layers)
    if n > total:
        raise ValueError(
            f"field 'draft_encoder_context': {n} draft layers but the target decoder has {total} to "
            f"initialize their cross-attention from; use num_draft_layers <= {total}"
        )
    layers = list(target.layers)[total - n :]
    for mine, theirs in zip(draft.layers, layers):
        if not (hasattr(theirs, "encoder_attn") and hasattr(theirs, "encoder_attn_layer_norm")):
            raise ValueError(
                "field 'draft_encoder_context': the target's decoder layers have no Whisper-style "
                "encoder_attn / encoder_attn_layer_norm to initialize the draft's cross-attention from"
            )
        copy_cross_attention(mine.encoder_attn, theirs.encoder_attn, theirs.encoder_attn_layer_norm)


__all__ = [
    "TargetAndDraft",
    "TargetDraftSettings",
    "TargetSettings",
    "build_target_and_draft",
    "check_warm_start_settings",
    "compile_target_layers",
    "draft_class_for",
    "init_encoder_context",
    "load_frozen_target",
    "new_draft",
    "prepare_target",
]
