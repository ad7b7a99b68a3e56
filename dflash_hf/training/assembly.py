"""What `DFlashTrainer` is assembled from, kept out of trainer.py so that callbacks and evaluation use it without
importing the trainer: the draft built from the arguments and the target (after seeding as the Trainer does), which
datasets are speech sources, and their lhotse loaders."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from accelerate.data_loader import DataLoaderShard
from transformers.trainer_utils import enable_full_determinism, set_seed

from dflash_hf.export.drafts import check_warm_start, check_warm_start_sizes, draft_class_for, load_draft_strict
from dflash_hf.models.configuration_dflash import DFlash2Fields, DFlashConfig
from dflash_hf.models.modeling_dflash import DFlashDecoderLayer, DFlashDraftModel
from dflash_hf.models.modeling_dflash_encoder import copy_cross_attention
from dflash_hf.ops.float8 import float8_draft_linears
from dflash_hf.settings import DEFAULT_NUM_DRAFT_LAYERS, LoaderSettings
from dflash_hf.targets.forward_graph import forward_graphs
from dflash_hf.targets.frozen import FrozenTarget, resolve_dtype
from dflash_hf.training.adaptation import apply_adaptation
from dflash_hf.training.training_args import DFlashDataArguments, DFlashTrainingArguments

logger = logging.getLogger(__name__)


def is_speech_source(dataset) -> bool:
    """Speech sources (paths, `dflash_hf.data.DataSource`s, lhotse `CutSet`s) are batched by the lhotse
    loader, not by the Trainer's sampler. Checked by module so lhotse is imported only when used."""
    items = dataset if isinstance(dataset, (list, tuple)) else [dataset]
    return bool(items) and all(
        isinstance(x, (str, Path)) or type(x).__module__.startswith(("lhotse.", "dflash_hf.data.")) for x in items
    )


def speech_loader(
    source,
    *,
    processor,
    target: FrozenTarget,
    args: DFlashTrainingArguments,
    data_args: DFlashDataArguments,
    shuffle: bool,
):
    """The lhotse token-budget loader of a speech source for this rank (already sharded by rank, so not
    re-prepared by accelerate)."""
    from dflash_hf.data import build_train_dataloader

    if processor is None:
        raise ValueError("speech data needs the target's processor: pass DFlashTrainer(processor=...)")
    on_gpu = args.device.type == "cuda"
    settings = LoaderSettings.of(
        data_args,  # the data options' token budget, padding side, buckets and sample checks (`BatchSettings`)
        max_tokens=args.packing_max_tokens if args.packing else data_args.max_tokens,
        shuffle=shuffle,
        seed=args.seed,
        world_size=args.world_size,
        rank=args.process_index,
        num_workers=args.dataloader_num_workers,
        packing=args.packing,
        compact_features=True,  # Whisper: the window rebuilt on the target's device (FrozenTarget.capture)
        # ... and on a GPU its features computed there from the waves (standard extractors); on the CPU the workers
        # compute them, beside the step; not under DeepSpeed, which casts floating inputs to its dtype
        device_features=on_gpu and not args.deepspeed,
        pin_memory=args.dataloader_pin_memory and on_gpu,  # the copy to the GPU waits for nothing
        mask_token_id=args.mask_token_id,  # refused where the template, the processor or a sample uses it
    )
    return build_train_dataloader(
        source, processor, target.model.config, settings, family=target.family, conversation=data_args.conversation()
    )


def host_batches(loader):
    """Keep an accelerate `DataLoaderShard`'s batches on the host: `get_batch_samples` plans anchors from host
    tensors (no device sync) and `DFlashTrainer._prepare_input` copies them to the device asynchronously."""
    if isinstance(loader, DataLoaderShard):
        loader.device = None
    return loader


def seed_like_trainer(args: DFlashTrainingArguments) -> None:
    """Seed every RNG as `Trainer.__init__` does, so a draft built (and adapted) before it is seeded too."""
    if args.full_determinism:
        enable_full_determinism(args.seed)
    else:
        set_seed(args.seed)


def prepare_target(target, args: DFlashTrainingArguments) -> FrozenTarget:
    """The frozen target (an HF model is wrapped in a `FrozenTarget`) in the training precision, checked for
    packing and given its CUDA-graph forwards (`target_cuda_graph`) before any draft is built."""
    if not isinstance(target, FrozenTarget):
        target = FrozenTarget(target, args.target_family)
    target.model.to(resolve_dtype(args.precision))
    if "target" in args.torch_compile_layers and args.device.type == "cuda":
        compile_target_layers(target)
    target.forward_graphs = forward_graphs(args.target_cuda_graph, target, args.device)
    if args.packing:
        target.check_packing()  # before the draft is built
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


def draft_for_training(model, args: DFlashTrainingArguments, target: FrozenTarget):
    """The draft to train: `model` checked against the target, or `build_draft`'s (after seeding, so its initial
    weights and LoRA's follow `--seed`), with its adaptation applied (`projection_only` filter or peft LoRA) and,
    with `float8_draft_linears`, its linear layers turned into FP8 ones."""
    seed_like_trainer(args)
    if model is None:
        model = build_draft(args, target)
    else:
        cfg = model.config
        target.validate(
            mask_token_id=cfg.mask_token_id, target_layer_ids=cfg.target_layer_ids, hidden_size=cfg.hidden_size
        )
        check_encoder_context(cfg, target)
    model = apply_adaptation(model, args)
    if args.float8_draft_linears:
        converted = float8_draft_linears(model)
        logger.info("float8_draft_linears: %d draft linear layers train with FP8 matmuls", len(converted))
    return model


def require_encoder(target: FrozenTarget, what: str) -> int:
    """The width of the target's encoder frames; a ValueError naming `draft_encoder_context` if it has no encoder."""
    if target.encoder_hidden_size is None:
        raise ValueError(
            f"field 'draft_encoder_context': {what}, but the target (family {target.family.name!r}) has "
            "no encoder; the opt-in is for encoder-decoder targets (Whisper): drop the flag or use a "
            "draft without encoder context"
        )
    return target.encoder_hidden_size


def check_encoder_context(config: DFlashConfig, target: FrozenTarget, source: str = "draft") -> None:
    """An encoder-context draft (outside the published contract) needs an encoder-decoder target of its width."""
    if not config.encoder_context:
        return
    require_encoder(target, f"the {source} attends to encoder frames")
    if config.encoder_hidden_size != target.encoder_hidden_size:
        raise ValueError(
            f"dflash_config.encoder_hidden_size is {config.encoder_hidden_size} but the target's "
            f"encoder frames are {target.encoder_hidden_size} wide: the {source} was trained for "
            "another target"
        )


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


def compile_draft_layers(model) -> None:
    """`torch.compile` each draft decoder layer in place (`torch_compile_layers: [draft]`)."""
    for module in model.modules():
        if isinstance(module, DFlashDecoderLayer):
            module.compile()


def build_draft(args: DFlashTrainingArguments, target: FrozenTarget) -> DFlashDraftModel:
    """A fresh draft sized from the target, or a strict warm start from `init_from_pretrained`."""
    if args.init_from_pretrained:
        draft = load_draft_strict(args.init_from_pretrained, block_size=args.block_size)
        check_warm_start(
            draft.config,
            variant=args.variant,
            target_layer_ids=args.target_layer_ids,
            mask_token_id=args.mask_token_id,
            vocab_size=target.vocab_size,
        )
        if args.draft_encoder_context and not draft.config.encoder_context:
            raise ValueError(
                f"field 'draft_encoder_context': the init_from_pretrained export "
                f"{args.init_from_pretrained} has no encoder context, and a warm start keeps the export's "
                "layers; drop the flag or train a fresh draft with it"
            )
        given = {"num_draft_layers": args.num_draft_layers, **DFlash2Fields.of(args).as_dict()}
        defaults = {"num_draft_layers": DEFAULT_NUM_DRAFT_LAYERS, **DFlash2Fields().as_dict()}
        check_warm_start_sizes(draft.config, given, defaults)
    else:
        target.validate(mask_token_id=args.mask_token_id, target_layer_ids=args.target_layer_ids)
        asked = "a new draft was asked to attend to encoder frames"
        width = require_encoder(target, asked) if args.draft_encoder_context else None
        config = DFlashConfig.from_target_config(
            target.text_config,
            mask_token_id=args.mask_token_id,
            variant=args.variant,
            num_hidden_layers=args.num_draft_layers,
            block_size=args.block_size,
            target_layer_ids=args.target_layer_ids,
            encoder_hidden_size=width,
            **DFlash2Fields.of(args).as_dict(),
        )
        config.vocab_size = target.vocab_size
        draft = draft_class_for(config)(config)
        if config.encoder_context:
            init_encoder_context(draft, target)
    cfg = draft.config
    target.validate(mask_token_id=cfg.mask_token_id, target_layer_ids=cfg.target_layer_ids, hidden_size=cfg.hidden_size)
    check_encoder_context(cfg, target, "init_from_pretrained export" if args.init_from_pretrained else "draft")
    return draft.to(resolve_dtype(args.precision))


__all__ = [
    "build_draft",
    "check_encoder_context",
    "compile_draft_layers",
    "compile_target_layers",
    "draft_for_training",
    "host_batches",
    "is_speech_source",
    "prepare_target",
    "seed_like_trainer",
    "speech_loader",
]
