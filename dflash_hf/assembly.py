"""What `DFlashTrainer` is assembled from, kept out of trainer.py so that callbacks and evaluation use it without
importing the trainer: the draft built from the arguments and the target, and which datasets are speech sources."""

from __future__ import annotations

from pathlib import Path

from accelerate.data_loader import DataLoaderShard

from .configuration_dflash import DFlashConfig
from .hub import check_warm_start, draft_class_for, load_draft_strict
from .modeling_dflash import DFlashDraftModel
from .target import FrozenTarget, resolve_dtype
from .training_args import DFlashTrainingArguments


def is_speech_source(dataset) -> bool:
    """Speech sources (paths, `dflash_hf.data.DataSource`s, lhotse `CutSet`s) are batched by the lhotse
    loader, not by the Trainer's sampler. Checked by module so lhotse is imported only when used."""
    items = dataset if isinstance(dataset, (list, tuple)) else [dataset]
    return bool(items) and all(
        isinstance(x, (str, Path)) or type(x).__module__.startswith(("lhotse.", "dflash_hf.data.")) for x in items
    )


def host_batches(loader):
    """Keep an accelerate `DataLoaderShard`'s batches on the host: `get_batch_samples` plans anchors from host
    tensors (no device sync) and `DFlashTrainer._prepare_input` copies them to the device asynchronously."""
    if isinstance(loader, DataLoaderShard):
        loader.device = None
    return loader


def build_draft(args: DFlashTrainingArguments, target: FrozenTarget) -> DFlashDraftModel:
    """A fresh draft sized from the target, or a strict warm start from `init_from_pretrained`."""
    if args.init_from_pretrained:
        draft = load_draft_strict(args.init_from_pretrained, block_size=args.block_size)
        check_warm_start(
            draft.config, variant=args.variant, target_layer_ids=args.target_layer_ids,
            mask_token_id=args.mask_token_id, vocab_size=target.vocab_size,
        )
    else:
        target.validate(mask_token_id=args.mask_token_id, target_layer_ids=args.target_layer_ids)
        config = DFlashConfig.from_target_config(
            target.text_config,
            mask_token_id=args.mask_token_id,
            variant=args.variant,
            num_hidden_layers=args.num_draft_layers,
            block_size=args.block_size,
            target_layer_ids=args.target_layer_ids,
            conv_kernel_size=args.conv_kernel_size,
            conv_group_size=args.conv_group_size,
            selector_rank=args.selector_rank,
            selector_top_k=args.selector_top_k,
        )
        config.vocab_size = target.vocab_size
        draft = draft_class_for(config)(config)
    cfg = draft.config
    target.validate(mask_token_id=cfg.mask_token_id, target_layer_ids=cfg.target_layer_ids, hidden_size=cfg.hidden_size)
    return draft.to(resolve_dtype(args.precision))


__all__ = ["build_draft", "host_batches", "is_speech_source"]
