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
from typing import TYPE_CHECKING

from dflash_hf.cli.config import apply_config, option_actions, parse_with_config
from dflash_hf.cli.options import help_parser
from dflash_hf.errors import EnvironmentFault
from dflash_hf.training.run_inputs import check_run_inputs

if TYPE_CHECKING:  # torch, transformers' Trainer and lhotse load only once a run starts
    from transformers import HfArgumentParser

    from dflash_hf.training.training_args import DFlashDataArguments, DFlashTrainingArguments

logger = logging.getLogger("dflash_hf")


def make_parser() -> HfArgumentParser:
    """The real parser: `DFlashTrainingArguments` (the DFlash groups and TrainingArguments) and the data group."""
    from transformers import HfArgumentParser

    from dflash_hf.training.training_args import DFlashDataArguments, DFlashTrainingArguments

    return HfArgumentParser((DFlashTrainingArguments, DFlashDataArguments))


def train(args: DFlashTrainingArguments, data_args: DFlashDataArguments) -> dict:
    """Train and export a draft (or validate one with `--validate_only true`), publish it with `--push_to_hub`, and
    report; returns the final metrics."""
    from dflash_hf.training.run import publish_draft, run_training

    publish_to = args.hub_model_id if args.push_to_hub else None
    outcome = run_training(args, data_args)
    metrics, export_dir = outcome.metrics, outcome.export_dir
    if export_dir is None or not outcome.reports:
        return metrics
    print(f"draft exported to {export_dir}")
    print(json.dumps(metrics, indent=2, sort_keys=True))
    if publish_to:
        metrics["hub_commit_url"] = publish_draft(args, data_args, export_dir, publish_to, metrics)
        print(f"draft published: {metrics['hub_commit_url']}")
    print("measure real tau and speed of the export against the target's greedy decoding (docs/EVALUATION.md):")
    print("  " + outcome.eval_command)
    return metrics


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
