"""What `DFlashTrainer` is assembled from, kept out of trainer.py so that callbacks and evaluation use it without
importing the trainer: the frozen target and the draft to train (`targets.builder`'s one pass, after seeding as the
Trainer does, then the draft's adaptation), which datasets are speech sources, and their lhotse loaders."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

from accelerate.data_loader import DataLoaderShard
from torch import nn
from transformers.trainer_utils import enable_full_determinism, set_seed

from dflash_hf.export.drafts import load_draft_strict
from dflash_hf.models.modeling_dflash import DFlashDecoderLayer
from dflash_hf.ops.float8 import float8_draft_linears
from dflash_hf.settings import LoaderSettings
from dflash_hf.targets.builder import TargetAndDraft, build_target_and_draft
from dflash_hf.targets.frozen import FrozenTarget, TargetModel
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


def target_and_draft(
    target: TargetModel, args: DFlashTrainingArguments, model: nn.Module | None = None, processor=None
) -> TargetAndDraft:
    """The frozen target and the draft to train, built and checked in one pass (`targets.builder`): `model` as given,
    else a strict warm start from `init_from_pretrained` or a new draft, made after seeding (so its initial weights
    and LoRA's follow `--seed`); then the draft's adaptation (`projection_only` filter or peft LoRA) and, with
    `float8_draft_linears`, its linear layers turned into FP8 ones. `processor`: the target's, for the mask-token
    candidates named when no `mask_token_id` is set."""
    seed_like_trainer(args)  # nothing the builder does before the draft draws random numbers
    warm_start = None
    if model is None and args.init_from_pretrained:
        warm_start = partial(load_draft_strict, args.init_from_pretrained, block_size=args.block_size)
    target, draft = build_target_and_draft(
        target, args, draft=model, warm_start=warm_start, device=args.device, processor=processor
    )
    draft = apply_adaptation(draft, args)
    if args.float8_draft_linears:
        converted = float8_draft_linears(draft)
        logger.info("float8_draft_linears: %d draft linear layers train with FP8 matmuls", len(converted))
    return TargetAndDraft(target, draft)


def compile_draft_layers(model) -> None:
    """`torch.compile` each draft decoder layer in place (`torch_compile_layers: [draft]`)."""
    for module in model.modules():
        if isinstance(module, DFlashDecoderLayer):
            module.compile()


__all__ = [
    "compile_draft_layers",
    "host_batches",
    "is_speech_source",
    "seed_like_trainer",
    "speech_loader",
    "target_and_draft",
]
