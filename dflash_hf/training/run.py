"""A `dflash-train` run from its parsed arguments: the checks before anything loads, the data pre-flight, the frozen
target, then either the validation of a draft (`--validate_only`) or training, the final evaluation and the export
(`run_training`); `publish_draft` uploads the export with its model card. `dflash_hf.cli.train` parses and reports."""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_hf.errors import DFlashUserError

if TYPE_CHECKING:
    from dflash_hf.data import DataSource
    from dflash_hf.training.training_args import DFlashDataArguments, DFlashTrainingArguments

logger = logging.getLogger("dflash_hf")


@dataclass
class TrainingOutcome:
    """What a run gives its caller: the final metrics, the export directory (None for `--validate_only`) and whether
    this process reports (the main process of the run)."""

    metrics: dict
    export_dir: str | None
    reports: bool
    eval_command: str | None = None  # the `dflash-eval` command of the export (`eval_command`)


def run_training(args: DFlashTrainingArguments, data_args: DFlashDataArguments) -> TrainingOutcome:
    """Train and export a draft (or validate one with `--validate_only true`). `--push_to_hub` is left to the caller
    (`publish_draft`): the Trainer's own checkpoint uploads are turned off."""
    from dflash_hf.targets.builder import load_frozen_target
    from dflash_hf.targets.processor import load_processor
    from dflash_hf.training.best_model import check_best_model_args, eval_prefixes
    from dflash_hf.training.row_preflight import check_data_rows, share_data_rows
    from dflash_hf.training.run_inputs import check_resume_path, check_run_inputs
    from dflash_hf.training.trainer import DFlashTrainer
    from dflash_hf.training.validate_only import check_validation, evaluate_and_report

    # training's own checks first (the files the arguments name, the best-model metric, the resume checkpoint),
    # then the run's inputs down to the target's directory (`check_run_inputs`, which the command line ran already)
    args.check_files()
    eval_sets = data_args.eval_sources()  # the named validation sets, once: checked here, evaluated by the trainer
    check_best_model_args(args, eval_prefixes(eval_sets))
    check_resume_path(args.resume_from_checkpoint)
    check_run_inputs(args, data_args)
    if args.validate_only:  # a trained draft to evaluate (the trainer only evaluates it: `validate_only.validate`)
        check_validation(args, eval_sets)
    if args.process_index == 0:  # the other ranks load their target meanwhile, then reuse rank 0's checks
        check_data_rows(data_args)
    target = load_frozen_target(args.target_name_or_path, args)  # its draft is built with the trainer
    processor = load_processor(args.target_name_or_path, args.trust_remote_code)
    share_data_rows(args.world_size, args.process_index)  # rank 0's row checks, for every rank's loaders
    args.push_to_hub = False  # `--push_to_hub` publishes the exported draft (`publish_draft`), not the checkpoints
    trainer = DFlashTrainer(
        args=args,
        target=target,
        processor=processor,
        data_args=data_args,
        train_dataset=None if args.validate_only else data_args.train_sources(),
        eval_dataset=eval_sets,
    )
    if args.validate_only:
        metrics = evaluate_and_report(trainer, list(eval_sets))
        return TrainingOutcome(metrics, None, args.process_index == 0)
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # TrainingInterrupted on SIGTERM
    metrics = dict(result.metrics)
    metrics["global_step"] = trainer.state.global_step  # fewer than max_steps when max_train_minutes stopped it
    if data_args.eval_data:
        metrics.update(trainer.final_eval_metrics())  # not a second evaluation of the last step
    trainer.save_state()  # <output_dir>/trainer_state.json: the whole log (benchmarks/tau_curve.py draws it)
    export_dir = trainer.export_draft()
    loader = getattr(trainer, "speech_train_loader", None)
    if loader is not None:
        metrics["skipped_samples"] = loader.bad_samples.num_skipped
        if loader.bad_samples.num_skipped:
            logger.warning(loader.bad_samples.summary())
    command = eval_command(args, data_args, export_dir, eval_sets)
    return TrainingOutcome(metrics, export_dir, trainer.is_world_process_zero(), command)


def eval_command(args, data_args: DFlashDataArguments, export_dir: str, eval_sets: dict[str, DataSource] | None) -> str:
    """The `dflash-eval` command of an export: its target, precision and first validation set of `eval_sets` (the
    run's `data_args.eval_sources()`; a placeholder to replace when the run had none); the conversation settings come
    from the export's record."""
    data = next(iter(eval_sets.values())).path if eval_sets else "HELD_OUT_MANIFEST.jsonl"
    words = ["dflash-eval", "--draft", export_dir, "--target", args.target_name_or_path, "--data", str(data)]
    words += ["--precision", args.precision]
    if data_args.allow_command_audio_sources:
        words += ["--allow_command_audio_sources", "true"]
    return shlex.join(words) + ("" if eval_sets else "  # a held-out manifest: the run had no --eval_data")


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return "/" in name and not Path(name).exists()


def card_target_id(target_name_or_path: str) -> str:
    """The target's Hub id for the model card: the given id, or the `_name_or_path` its local config.json
    records when that is a Hub id; else the directory's name (warned: the card then names no Hub model)."""
    path = Path(target_name_or_path)
    if not path.is_dir():
        return target_name_or_path
    config = path / "config.json"
    recorded = json.loads(config.read_text()).get("_name_or_path", "") if config.is_file() else ""
    if _is_hub_id(recorded):
        return recorded
    logger.warning(
        "push_to_hub: the target %s is a local directory that records no Hub id; the model card names it %r",
        target_name_or_path,
        path.name,
    )
    return path.name


def publish_draft(args, data_args: DFlashDataArguments, export_dir: str, repo_id: str, metrics: dict) -> str:
    """Upload the exported draft with its generated model card (`hub.push_draft_to_hub`); the commit URL."""
    from transformers import PretrainedConfig

    from dflash_hf.export.hub import DraftCardInfo, push_draft_to_hub, target_serving_facts

    target_config, _ = PretrainedConfig.get_config_dict(args.target_name_or_path)  # the target's config.json, as is
    names = list(data_args.eval_sources() or {})
    tau_est = metrics.get(f"eval_{names[0]}_tau_est") if names else None
    sources = ", ".join(Path(p).name for p in data_args.train_data or [])
    info = DraftCardInfo(
        target_id=card_target_id(args.target_name_or_path),
        data_summary=f"{sources}; {metrics.get('global_step', args.max_steps)} steps, {args.label_source} labels.",
        tau_est=tau_est,
        eval_name=names[0] if tau_est is not None else None,
        **target_serving_facts(target_config),  # which engine serves the draft: the card says so
    )
    try:
        return push_draft_to_hub(
            export_dir, repo_id, card_info=info, private=bool(args.hub_private_repo), token=args.hub_token
        )
    except OSError as err:  # huggingface_hub's HTTP errors are OSErrors: no token, no access, offline
        raise DFlashUserError(
            f"push_to_hub: uploading the draft to {repo_id} failed ({err}). The trained draft is exported in "
            f"{export_dir}: log in (`hf auth login`) or pass --hub_token, then publish it with "
            "dflash_hf.export.hub.push_draft_to_hub"
        ) from err


__all__ = ["TrainingOutcome", "card_target_id", "eval_command", "publish_draft", "run_training"]
