"""The speech recipes of examples/configs/ parse as dflash-train configs, read the paths benchmarks/real_targets.py and
the commands in their comments write, and the commands in their comments parse."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
from utils import REPO_ROOT, loaded_script

from dflash_hf.cli import train as cli_train
from dflash_hf.cli.config import parse_with_config
from dflash_hf.cli.generate_labels import make_parser as labels_parser

CONFIGS = REPO_ROOT / "examples" / "configs"
RECIPES = ("whisper_base_dflash2.yaml", "speech_llm_dflash2.yaml", "speech_llm_qwen2_dflash2.yaml")


def _commands(config: Path) -> list[list[str]]:
    """The comment's commands: `$B` / `$S` expanded, continuation lines joined, a `for X in ...; do ...; done` loop
    unrolled."""
    lines = [line[1:].strip() for line in config.read_text().splitlines() if line.startswith("#   ")]
    joined, text = [], ""
    for line in lines:
        text += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            joined.append(text.strip())
            text = ""
    shells = {"$B": "real_targets.py --cache_dir bench", "$S": "speech_llm.py"}
    commands = []
    for command in joined:
        loop = re.fullmatch(r"for (\w+) in ([^;]+); do (.+); done", command)
        if loop:
            var, values, body = loop.groups()
            joined += [body.replace(f"${var}", value) for value in values.split()]
            continue
        for part in command.split(" && "):
            for var, script in shells.items():
                part = part.replace(var, f"python benchmarks/{script}")
            if part.startswith(("python", "dflash-")):
                commands.append(shlex.split(part))
    return commands


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_parses_keeps_the_draft_by_its_real_tau_and_reads_what_the_benchmark_writes(name):
    config = CONFIGS / name
    args, data_args = parse_with_config(cli_train.make_parser(), ["--config", str(config)])
    assert args.variant == "dflash2" and args.block_size == 8 and args.label_source == "ground_truth"
    assert args.eval_real_tau and args.metric_for_best_model == "dev_tau" and args.load_best_model_at_end
    assert args.save_steps == args.eval_steps and args.max_train_minutes <= 25
    with loaded_script(REPO_ROOT / "benchmarks" / "real_targets.py") as rt:
        from quality_steps import configs, fetch, labels  # the script's steps, importable once it is loaded

        bench = Path("bench")
        if name.startswith("whisper"):
            generated = labels.whisper_label_manifests(bench)
            assert args.target_name_or_path == str(fetch.target_hf_dir(bench, "whisper-base"))
            assert args.mask_token_id == configs.WHISPER_MASK_ID and args.draft_encoder_context
            assert data_args.train_data == [str(generated["train"])]
            assert data_args.eval_data == [f"dev={generated['dev']}"]
        commands = _commands(config)
        for command in commands:
            if command[:2] == ["python", "benchmarks/real_targets.py"]:
                rt.make_parser().parse_args(command[2:])
    labelled, outputs = [], []
    for command in commands:
        if command[0] == "dflash-generate-labels":
            labelled.append(argparse.ArgumentParser.parse_args(labels_parser(), command[1:]))
        if command[0] == "dflash-train":
            assert command[1:] == ["--config", f"examples/configs/{name}"]  # the recipe runs unchanged
        if command[:2] == ["python", "benchmarks/speech_llm.py"] and "--out" in command:
            outputs.append(command[command.index("--out") + 1])
    if name.startswith("speech_llm"):  # the target and the labels are what the comment's commands write
        assert args.target_name_or_path in outputs
        assert labelled and {g.model for g in labelled} == {args.target_name_or_path}
        assert labelled[0].prompt == data_args.prompt == "Transcribe the audio."
        sets = [*data_args.train_data, *(e.split("=", 1)[1] for e in data_args.eval_data)]
        assert sorted(g.output for g in labelled) == sorted(sets)
