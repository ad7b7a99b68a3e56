"""`dflash-train`: train (or only validate) a DFlash / DFlash2 draft against a frozen target.

    dflash-train --config examples/configs/adapt.yaml --target_name_or_path /models/qwen3-asr \\
        --train_data train.jsonl --eval_data dev=dev.jsonl --mask_token_id 151669 --output_dir runs/x
"""

from __future__ import annotations

import json
import logging

from transformers import AutoProcessor, AutoTokenizer, HfArgumentParser

from ..families import get_tokenizer
from ..launch import configure_cpu_threads
from ..mask_token import mask_token_candidates, missing_mask_token_message
from ..target import FrozenTarget, load_target
from ..trainer import DFlashTrainer
from ..training_args import DFlashDataArguments, DFlashTrainingArguments
from .config import parse_with_config

logger = logging.getLogger("dflash_hf")


def make_parser() -> HfArgumentParser:
    return HfArgumentParser((DFlashTrainingArguments, DFlashDataArguments))


def load_processor(path: str):
    """The target's processor (audio targets) or tokenizer (text targets), from its directory."""
    try:
        return AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return AutoTokenizer.from_pretrained(path)


def train(args: DFlashTrainingArguments, data_args: DFlashDataArguments) -> dict:
    """Train and export a draft (or validate one with `--validate_only true`); returns the final metrics."""
    if not args.target_name_or_path:
        raise ValueError("--target_name_or_path is required: the directory of the frozen target model")
    if args.validate_only:
        if not data_args.eval_data:
            raise ValueError("--validate_only true needs --eval_data NAME=PATH [...] to validate on")
    elif not data_args.train_data:
        raise ValueError("--train_data is required: NeMo manifests or lhotse cut files (or --validate_only true)")
    target = FrozenTarget(
        load_target(args.target_name_or_path, args.precision, args.target_strict_load), args.target_family
    )
    processor = load_processor(args.target_name_or_path)
    if args.mask_token_id is None and not args.init_from_pretrained:
        tokenizer = get_tokenizer(processor)
        candidates = mask_token_candidates(
            tokenizer, target.vocab_size, target_config=target.model.config,
            extra_ids=target.mask_token_candidates(tokenizer),
        )
        raise ValueError(missing_mask_token_message(candidates))
    if args.validate_only:
        from ..evaluation import validate

        return validate(args, data_args.eval_sources(), target=target, processor=processor, data_args=data_args)

    trainer = DFlashTrainer(
        args=args,
        target=target,
        processor=processor,
        data_args=data_args,
        train_dataset=data_args.train_sources(),
        eval_dataset=data_args.eval_sources(),
    )
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = dict(result.metrics)
    if data_args.eval_data:
        metrics.update(trainer.evaluate())
    export_dir = trainer.export_draft()
    loader = getattr(trainer, "speech_train_loader", None)
    if loader is not None:
        metrics["skipped_samples"] = loader.bad_samples.num_skipped
        if loader.bad_samples.num_skipped:
            logger.warning(loader.bad_samples.summary())
    if trainer.is_world_process_zero():
        print(f"draft exported to {export_dir}")
        print(json.dumps(metrics, indent=2, sort_keys=True))
    return metrics


def run(argv: list[str] | None = None) -> dict:
    """Parse `argv` (`--config file.yaml` plus overrides) and `train`."""
    return train(*parse_with_config(make_parser(), argv))


def main(argv: list[str] | None = None) -> None:
    configure_cpu_threads()  # before any torch work: threads per process from the free cores
    run(argv)


if __name__ == "__main__":
    main()
