"""`dflash-train`: train (or only validate) a DFlash / DFlash2 draft against a frozen target.

    dflash-train --config examples/configs/adapt.yaml --target_name_or_path /models/qwen3-asr \\
        --train_data train.jsonl --eval_data dev=dev.jsonl --mask_token_id 151669 --output_dir runs/x
    dflash-train ... --push_to_hub true --hub_model_id me/qwen3-asr-dflash   # publish the exported draft

`--help` and argument errors are answered before torch loads (`cli.options`); a user error is one line and
exit status 2 (`dflash_hf.errors`, `DFLASH_DEBUG=1` for the traceback).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_hf.cli.config import apply_config, option_actions, parse_with_config
from dflash_hf.cli.options import help_parser
from dflash_hf.errors import DFlashUserError, EnvironmentFault
from dflash_hf.settings import ModelSettings, RunSettings
from dflash_hf.targets.processor import check_model_dir, load_processor
from dflash_hf.training.argument_groups import check_data_paths

if TYPE_CHECKING:  # torch, transformers' Trainer and lhotse load only once a run starts
    from transformers import HfArgumentParser

    from dflash_hf.training.training_args import DFlashDataArguments, DFlashTrainingArguments

logger = logging.getLogger("dflash_hf")


def make_parser() -> HfArgumentParser:
    """The real parser: `DFlashTrainingArguments` (the DFlash groups and TrainingArguments) and the data group."""
    from transformers import HfArgumentParser

    from dflash_hf.training.training_args import DFlashDataArguments, DFlashTrainingArguments

    return HfArgumentParser((DFlashTrainingArguments, DFlashDataArguments))


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


def check_run_inputs(args, data_args) -> None:
    """What every run needs: a target (an existing directory when given as a path) and data to train or
    validate on. `args` / `data_args`: the parsed arguments (or the light parser's namespace for both)."""
    if not args.target_name_or_path:
        raise ValueError("--target_name_or_path is required: the directory of the frozen target model")
    check_model_dir(args.target_name_or_path, "target_name_or_path", "the frozen target")
    if args.validate_only:
        if not data_args.eval_data:
            raise ValueError("--validate_only true needs --eval_data NAME=PATH [...] to validate on")
    elif not data_args.train_data:
        raise ValueError("--train_data is required: NeMo manifests or lhotse cut files (or --validate_only true)")
    check_data_paths(data_args)
    trust = getattr(args, "trust_remote_code", ModelSettings.trust_remote_code)
    check_remote_code(args.target_name_or_path, bool(trust))
    check_run_dirs(args)


# The target directory's files whose `auto_map` names code shipped with it (model, processor, tokenizer).
REMOTE_CODE_CONFIGS = ("config.json", "processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


def check_remote_code(target: str, trusted: bool) -> None:
    """A target directory whose config.json (or processor / tokenizer config) has an `auto_map` ships its own code,
    which loading it would run in this process: refused unless `--trust_remote_code true`."""
    for name in REMOTE_CODE_CONFIGS:
        config = Path(target).expanduser() / name
        if not config.is_file():
            continue
        try:
            raw = json.loads(config.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ValueError(f"--target_name_or_path {target}: {config} is not readable JSON ({err})") from err
        auto_map = raw.get("auto_map") if isinstance(raw, dict) else None
        if auto_map and not trusted:
            names = ", ".join(sorted(auto_map)) if isinstance(auto_map, dict) else str(auto_map)
            raise ValueError(
                f"--target_name_or_path {target}: its {name} has an auto_map ({names}), code of its own that "
                "loading it would run; pass --trust_remote_code true only if you trust that directory's code, else "
                "use a target that transformers implements"
            )


def check_run_dirs(args) -> None:
    """The run's output and export directories (`training.run_identity.check_run_directories`), before anything
    loads; a validation writes only its metrics, so it is checked only for writing into the target."""
    from dflash_hf.training.run_identity import check_not_in_target, check_run_directories

    output_dir = getattr(args, "output_dir", None) or "trainer_output"  # TrainingArguments' default
    export_dir = getattr(args, "export_dir", None) or f"{output_dir}/draft"
    if args.validate_only:
        check_not_in_target(output_dir, "output_dir", args.target_name_or_path)
        return
    resume = getattr(args, "resume_from_checkpoint", None)
    resuming = resume is not None and str(resume).strip().lower() not in ("", "false")
    check_run_directories(
        output_dir,
        export_dir,
        resuming=resuming,
        overwrite=bool(getattr(args, "overwrite_output_dir", RunSettings.overwrite_output_dir)),
        target=args.target_name_or_path,
    )


def check_data_rows(data_args: DFlashDataArguments) -> None:
    """The data pre-flight on rank 0 (`training.row_preflight`): every row of every train and eval source once,
    without audio, before the target loads (in parallel for a large file)."""
    from dflash_hf.training.row_preflight import check_data_rows as check_every_row

    check_every_row(data_args)


def check_resume_path(resume) -> None:
    """A checkpoint given by path is read as resume will read it (`checkpoints.checkpoint_problem`: truncated files,
    pickled code) before the target loads; `true` picks among the checkpoints when training starts."""
    from dflash_hf.training.checkpoints import check_checkpoint_readable, resume_path

    if resume_path(resume) is not None:
        check_checkpoint_readable(resume)


def train(args: DFlashTrainingArguments, data_args: DFlashDataArguments) -> dict:
    """Train and export a draft (or validate one with `--validate_only true`); returns the final metrics."""
    from dflash_hf.targets.builder import load_frozen_target
    from dflash_hf.training.best_model import check_best_model_args, eval_prefixes
    from dflash_hf.training.row_preflight import share_data_rows
    from dflash_hf.training.trainer import DFlashTrainer

    check_run_inputs(args, data_args)
    args.check_files()
    eval_sets = data_args.eval_sources()  # the named validation sets, once: checked here, evaluated by the trainer
    check_best_model_args(args, eval_prefixes(eval_sets))
    if args.process_index == 0:  # the other ranks load their target meanwhile, then reuse rank 0's checks
        check_data_rows(data_args)
    check_resume_path(args.resume_from_checkpoint)
    target = load_frozen_target(args.target_name_or_path, args)  # its draft is built with the trainer
    processor = load_processor(args.target_name_or_path, args.trust_remote_code)
    share_data_rows(args.world_size, args.process_index)  # rank 0's row checks, for every rank's loaders
    if args.validate_only:
        from dflash_hf.training.validate_only import validate

        return validate(args, eval_sets, target=target, processor=processor, data_args=data_args)

    publish_to = args.hub_model_id if args.push_to_hub else None
    # `--push_to_hub` publishes the exported draft at the end (below), not the Trainer's checkpoints.
    args.push_to_hub = False
    trainer = DFlashTrainer(
        args=args,
        target=target,
        processor=processor,
        data_args=data_args,
        train_dataset=data_args.train_sources(),
        eval_dataset=eval_sets,
    )
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
    if trainer.is_world_process_zero():
        print(f"draft exported to {export_dir}")
        print(json.dumps(metrics, indent=2, sort_keys=True))
        if publish_to:
            metrics["hub_commit_url"] = publish_draft(args, data_args, export_dir, publish_to, metrics)
            print(f"draft published: {metrics['hub_commit_url']}")
        print("measure real tau and speed of the export against the target's greedy decoding (docs/EVALUATION.md):")
        print("  " + eval_command(args, data_args, export_dir))
    return metrics


def eval_command(args, data_args: DFlashDataArguments, export_dir: str) -> str:
    """The `dflash-eval` command of an export: its target, precision and first validation set (a placeholder to
    replace when the run had none); the conversation settings come from the export's record."""
    sources = data_args.eval_sources()
    data = next(iter(sources.values())).path if sources else "HELD_OUT_MANIFEST.jsonl"
    words = ["dflash-eval", "--draft", export_dir, "--target", args.target_name_or_path, "--data", str(data)]
    words += ["--precision", args.precision]
    if data_args.allow_command_audio_sources:
        words += ["--allow_command_audio_sources", "true"]
    return shlex.join(words) + ("" if sources else "  # a held-out manifest: the run had no --eval_data")


def option_names() -> list[str]:
    """The command's option names (for user-error messages), from the light parser when it is available."""
    return list(option_actions(help_parser() or make_parser()))


def check_command_line(argv: list[str]) -> None:
    """Answer `--help` and reject bad options, bad option values, a bad `--config` file and a missing target or
    data before torch loads (`options.help_parser`); argparse exits (0 for help, 2 for an error) as usual."""
    parser = help_parser()
    if parser is not None:
        namespace = parser.parse_args(apply_config(parser, argv))
        check_run_inputs(namespace, namespace)


def run(argv: list[str] | None = None) -> dict:
    """Parse `argv` (`--config file.yaml` plus overrides) and `train`."""
    return train(*parse_with_config(make_parser(), argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    check_command_line(argv)
    from dflash_hf.ops.cpu_threads import configure_cpu_threads

    configure_cpu_threads()  # before any torch work: threads per process from the free cores
    from dflash_hf.training.step_guards import TrainingInterrupted

    try:
        run(argv)
    except TrainingInterrupted as stop:  # SIGTERM / SIGINT: a complete checkpoint is saved; exit 128 + signal
        print(f"dflash-train: {stop}", file=sys.stderr)
        return stop.exit_code
    except EnvironmentFault as fault:  # full disk, killed loader worker, GPU out of memory: exit 75 (console)
        fault.resume_command = resume_command(argv, resume=fault.checkpoint is not None)
        raise
    return 0


def resume_command(argv: list[str], resume: bool = True) -> str:
    """The command line that resumes this run: `dflash-train ARGV --resume_from_checkpoint true` (any resume option
    of `argv` replaced; `resume=False`: the command as given, to start again). Under a launcher (torchrun,
    accelerate) the same launcher takes these arguments."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume_from_checkpoint":
            skip = True
        elif not arg.startswith("--resume_from_checkpoint="):
            args.append(arg)
    if not resume:
        args = list(argv)
    line = shlex.join(["dflash-train", *args] + (["--resume_from_checkpoint", "true"] if resume else []))
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    return f"`{line}`" + (" (through the same launcher as this run)" if launched else "")


if __name__ == "__main__":
    from dflash_hf.cli.console import train as console_train

    console_train()
