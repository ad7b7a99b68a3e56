"""`dflash-train`'s command line: grouped help (DFlash groups first, `--config` documented), help and argument
errors answered before torch loads, the same options as the real parser, user errors as exit status 2, and
`--push_to_hub` publishing the exported draft (HfApi faked: no network)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from transformers import TrainingArguments
from utils import REPO_ROOT, make_args, tiny_draft_config

from dflash_hf import DFlashDraftModel
from dflash_hf.cli import console, options
from dflash_hf.cli import train as cli_train
from dflash_hf.cli.config import add_config_option
from dflash_hf.errors import DFlashUserError
from dflash_hf.training import argument_groups
from dflash_hf.training.run import eval_command
from dflash_hf.training.training_args import DFlashDataArguments


def _help() -> str:
    return options.help_parser().format_help()


def test_help_lists_dflash_groups_first_then_trainer_sections_then_advanced_and_experimental():
    text = _help()
    titles = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert titles[:7] == [
        "options",
        "DFlash model and draft",
        "DFlash objective: blocks, labels and loss",
        "DFlash data",
        "DFlash adaptation of a warm-started draft",
        "DFlash packed batches",
        "DFlash run: validation, real tau, compilation",
    ]
    assert titles[-2:] == [argument_groups.ADVANCED_GROUP, argument_groups.EXPERIMENTAL_GROUP]
    assert all(t.startswith("TrainingArguments: ") for t in titles[7:-2]) and len(titles) > 20
    assert "TrainingArguments: Hub Integration" in titles
    assert "--config FILE.yaml" in text.split("DFlash model and draft:")[0]
    assert text.index("--block_size") < text.index("--train_data") < text.index("--learning_rate")
    assert text.index("--learning_rate") < text.index("--ce_chunk_size") < text.index("--float8_lm_head")
    assert "AdamW learning rate (DFlash default 6e-4)." in text  # DFlash defaults of inherited fields


def _group_options(text: str, title: str) -> list[str]:
    """The `--name` options listed under one `--help` group (each option's first spelling)."""
    body = text.split(f"\n{title}:\n", 1)[1].split("\n\n", 1)[0]
    return [line.split()[0] for line in body.splitlines() if line.startswith("  --")]


def test_main_dflash_groups_list_at_most_40_options_and_move_tuning_and_experimental_later():
    text = _help()
    main = [o for g in argument_groups.HELP_GROUPS for o in _group_options(text, g._argument_group_name)]
    assert len(main) == len(set(main)) <= 40
    advanced = _group_options(text, argument_groups.ADVANCED_GROUP)
    assert {"--ce_chunk_size", "--target_cuda_graph", "--num_buckets", "--allow_url_audio_sources"} <= set(advanced)
    experimental = _group_options(text, argument_groups.EXPERIMENTAL_GROUP)
    assert experimental == ["--draft_encoder_context", "--float8_draft_linears", "--float8_lm_head"]
    assert "--compile_draft_layers" not in text and "--compile_target" not in text  # deprecated: hidden, accepted


def test_old_compile_options_still_work_with_a_deprecation_warning(tmp_path):
    config = tmp_path / "old.yaml"
    config.write_text("compile_draft_layers: true\n")
    argv = ["--config", str(config), "--compile_target", "true", "--output_dir", str(tmp_path / "out"), "--use_cpu"]
    with pytest.warns(FutureWarning, match=r"compile_draft_layers=true is deprecated.*torch_compile_layers: \[draft\]"):
        args, _ = cli_train.parse_with_config(cli_train.make_parser(), argv)
    assert args.torch_compile_layers == ["draft", "target"]
    assert make_args(tmp_path, torch_compile_layers=["target", "draft", "target"]).torch_compile_layers == [
        "draft",
        "target",
    ]
    with pytest.raises(ValueError, match=r"torch_compile_layers \['encoder'\]: \['encoder'\] are not models"):
        make_args(tmp_path, torch_compile_layers=["encoder"])


def test_missing_data_files_are_refused_by_the_pre_flight_not_by_the_arguments(tmp_path):
    missing = str(tmp_path / "missing.jsonl")
    data_args = DFlashDataArguments(train_data=[missing])  # building the arguments reads no file
    args = SimpleNamespace(target_name_or_path=str(tmp_path), validate_only=False)
    with pytest.raises(FileNotFoundError, match=r"data file '.*missing.jsonl' does not exist"):
        cli_train.check_run_inputs(args, data_args)


def test_decoding_switches_are_one_options_object_shared_by_eval(tmp_path):
    from dflash_hf.export.evaluation_setup import check_evaluation_inputs
    from dflash_hf.generation.decode_options import DecodeOptions
    from dflash_hf.settings.decode import DecodeSettings
    from dflash_hf.settings.evaluation import EvalSettings

    steps = DecodeSettings(draft_cuda_graph="off", verify_cuda_graph="on")
    assert DecodeOptions.from_settings(steps) == DecodeOptions(draft_cuda_graph=False, verify_cuda_graph=True)
    with pytest.raises(ValueError, match="--verify_cuda_graph must be one of"):
        DecodeSettings(verify_cuda_graph="yes")
    (tmp_path / "draft").mkdir()
    (tmp_path / "data.jsonl").write_text("")
    args = EvalSettings(draft=str(tmp_path / "draft"), target="openai/whisper-base", data=str(tmp_path / "data.jsonl"))
    assert DecodeOptions.from_settings(args, tree_budget=8) == DecodeOptions(None, None, 8)
    check_evaluation_inputs(args)  # a Hub id is left to transformers
    for bad, message in (
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"num_samples": -1}, "num_samples must be >= 0 (0 = all), got -1"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            dataclasses.replace(args, **bad)
    missing = EvalSettings(draft=str(tmp_path / "draft"), target=str(tmp_path / "nope"), data=args.data)
    with pytest.raises(FileNotFoundError, match=r"--target=.*nope: the directory does not exist"):
        check_evaluation_inputs(missing)


def test_every_dflash_option_has_help():
    for group in argument_groups.HELP_GROUPS + argument_groups.LATE_HELP_GROUPS:
        for f in dataclasses.fields(group):
            assert f.metadata.get("help"), f"{group.__name__}.{f.name} has no help"


def test_light_parser_has_exactly_the_real_options():
    real = cli_train.make_parser()
    add_config_option(real)
    assert set(options.help_parser()._option_string_actions) == set(real._option_string_actions)
    init_fields = {f.name for f in dataclasses.fields(TrainingArguments) if f.init and not f.name.startswith("_")}
    assert init_fields <= {o.name for o in options.trainer_options()}


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + str(REPO_ROOT / "tests")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT)


def test_help_and_argument_errors_do_not_load_torch(tmp_path):
    missing = str(tmp_path / "missing")
    cases = [
        ["--help"],
        ["--gamma", "x"],
        ["--no_such_option", "1"],
        ["--variant", "dflash3"],
        [],
        ["--target_name_or_path", missing, "--train_data", "t.jsonl"],
    ]
    code = (
        "import sys\n"
        "from dflash_hf.cli.console import run_command\n"
        f"for argv in {cases!r}:\n"
        "    try:\n"
        "        code = run_command('dflash-train', argv)\n"
        "    except SystemExit as e:\n"
        "        code = e.code\n"
        "    print('exit', code, argv[0] if argv else '-')\n"
        "print('heavy', sorted(m for m in ('torch', 'lhotse', 'transformers.trainer') if m in sys.modules))\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line for line in lines if line.startswith("exit")] == [
        "exit 0 --help",
        "exit 2 --gamma",
        "exit 2 --no_such_option",
        "exit 2 --variant",
        "exit 2 -",
        "exit 2 --target_name_or_path",
    ]
    assert lines[-1] == "heavy []"
    assert "argument --gamma: invalid float value: 'x'" in out.stderr
    assert "dflash-train: error: unknown option --no_such_option" in out.stderr
    assert "dflash-train: error: --target_name_or_path is required" in out.stderr
    assert f"dflash-train: error: --target_name_or_path {missing}: the directory does not exist" in out.stderr


def test_bad_yaml_is_refused_before_torch_loads(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("num_anchors: 8.5\n")
    code = (
        "import sys\n"
        "from dflash_hf.cli.console import run_command\n"
        f"print('rc', run_command('dflash-train', ['--config', {str(config)!r}]))\n"
        "print('torch' in sys.modules)\n"
    )
    out = _run(code)
    assert out.stdout.split() == ["rc", "2", "False"], out.stderr
    assert f"--config {config} line 1: num_anchors: 8.5 is a number; give an integer" in out.stderr


def _export(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    config = tiny_draft_config(
        {"mask_token_id": 5, "target_layer_ids": [1, 2]},
        block_size=8,
        num_target_layers=4,
        hidden_size=32,
        head_dim=8,
        vocab_size=40,
    )
    out = tmp_path / "draft"
    DFlashDraftModel(config).save_pretrained(out)
    return out


def test_push_to_hub_needs_a_repo_id(tmp_path):
    with pytest.raises(ValueError, match=r"push_to_hub=true publishes the exported draft to hub_model_id.*got None"):
        make_args(tmp_path, push_to_hub=True)
    with pytest.raises(ValueError, match="validate_only=true trains none"):
        make_args(tmp_path, push_to_hub=True, hub_model_id="me/d", validate_only=True)


def _fake_training_run(tmp_path: Path, monkeypatch, upload) -> tuple[dict, callable]:
    """`cli.train.train` with the expensive parts faked (target, Trainer) and HfApi replaced: no network.
    `upload(folder_path)` plays `HfApi.upload_folder`. Returns what the fakes saw and a function running train()."""
    export = _export(tmp_path)
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps({"_name_or_path": "org/tiny-asr"}))
    manifest = tmp_path / "dev.jsonl"
    manifest.write_text("")
    seen = {}

    class FakeTrainer:
        def __init__(self, *, args, **kwargs):
            seen["trainer_push_to_hub"] = args.push_to_hub
            self.state = SimpleNamespace(global_step=7)  # as if max_train_minutes had stopped it early

        def train(self, resume_from_checkpoint=None):
            return SimpleNamespace(metrics={"train_loss": 1.0})

        def final_eval_metrics(self):
            return {"eval_dev_tau_est": 3.5}

        def export_draft(self):
            return str(export)

        def is_world_process_zero(self):
            return True

        def save_state(self):
            pass

    class FakeApi:
        def __init__(self, token=None):
            seen["token"] = token

        def create_repo(self, repo_id, **kwargs):
            seen["repo"] = (repo_id, kwargs["private"])

        def upload_folder(self, *, repo_id, folder_path, **kwargs):
            seen["files"] = sorted(os.listdir(folder_path))
            seen["card"] = Path(folder_path, "README.md").read_text()
            upload(folder_path)
            return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/1")

    import dflash_hf.targets.builder
    import dflash_hf.targets.processor
    import dflash_hf.training.row_preflight
    import dflash_hf.training.trainer

    monkeypatch.setattr(dflash_hf.training.trainer, "DFlashTrainer", FakeTrainer)
    monkeypatch.setattr(dflash_hf.targets.builder, "load_frozen_target", lambda *a, **k: None)
    monkeypatch.setattr(dflash_hf.targets.processor, "load_processor", lambda path, trust_remote_code=False: None)
    monkeypatch.setattr(dflash_hf.training.row_preflight, "check_data_rows", lambda data_args: None)  # reads no data
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    args = make_args(
        tmp_path,
        target_name_or_path=str(target_dir),
        mask_token_id=5,
        push_to_hub=True,
        hub_model_id="me/tiny-draft",
        hub_token="tok",
        hub_private_repo=True,
        max_steps=3,
    )
    data_args = DFlashDataArguments(train_data=[str(manifest)], eval_data=[f"dev={manifest}"])
    return seen, lambda: cli_train.train(args, data_args)


def test_push_to_hub_publishes_the_exported_draft(tmp_path, monkeypatch):
    seen, run = _fake_training_run(tmp_path, monkeypatch, upload=lambda folder: None)
    metrics = run()
    assert seen["trainer_push_to_hub"] is False  # no checkpoint uploads, no Trainer model card
    assert metrics["hub_commit_url"] == "https://huggingface.co/me/tiny-draft/commit/1"
    assert seen["repo"] == ("me/tiny-draft", True) and seen["token"] == "tok"
    assert seen["files"] == [
        "README.md",
        "config.json",
        "configuration_dflash.py",
        "draft_fields.py",
        "model.safetensors",
        "modeling_dflash.py",
        "modeling_dflash_encoder.py",
    ]
    card = seen["card"]
    assert "base_model: org/tiny-asr" in card and "| target | `org/tiny-asr` |" in card
    assert "| metric (dev) | value |" in card and "| 3.500 |" in card
    assert "dev.jsonl; 7 steps, ground_truth labels." in card


def test_a_training_run_ends_with_the_eval_command_of_its_export(tmp_path, monkeypatch, capsys):
    from dflash_hf.cli import eval as cli_eval
    from dflash_hf.cli.config import parse_with_config

    _, run = _fake_training_run(tmp_path, monkeypatch, upload=lambda folder: None)
    run()
    *_, intro, command = capsys.readouterr().out.rstrip().splitlines()
    assert intro.startswith("measure real tau and speed of the export") and command.startswith("  dflash-eval ")
    (args,) = parse_with_config(cli_eval.make_parser(), shlex.split(command)[1:])
    assert (args.draft, args.target, args.data) == (
        str(tmp_path / "draft"),
        str(tmp_path / "target"),
        str(tmp_path / "dev.jsonl"),
    )
    assert args.precision == "fp32"
    # a run without validation data: the data is a placeholder, said so
    no_dev = eval_command(
        args=SimpleNamespace(target_name_or_path="t", precision="bf16"),
        data_args=DFlashDataArguments(train_data=["a.jsonl"]),
        export_dir="runs/x/draft",
        eval_sets=None,
    )
    assert no_dev == (
        "dflash-eval --draft runs/x/draft --target t --data HELD_OUT_MANIFEST.jsonl --precision bf16"
        "  # a held-out manifest: the run had no --eval_data"
    )


def test_failed_upload_is_a_user_error_that_keeps_the_export(tmp_path, monkeypatch, capsys):
    def refuse(folder):
        raise ConnectionError("401 Unauthorized")  # huggingface_hub HTTP errors are OSErrors too

    _, run = _fake_training_run(tmp_path, monkeypatch, upload=refuse)
    with pytest.raises(
        DFlashUserError,
        match=rf"uploading the draft to me/tiny-draft failed \(401 Unauthorized\)"
        rf".*exported in {tmp_path / 'draft'}: log in",
    ):
        run()
    assert '"eval_dev_tau_est": 3.5' in capsys.readouterr().out  # the run's results were printed first


def test_console_argparse_error_is_status_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        console.run_command("dflash-train", ["--block_size", "many"])
    assert exit_info.value.code == 2
    assert "argument --block_size/--block-size: invalid int value: 'many'" in capsys.readouterr().err


def test_every_console_script_reports_user_errors_as_status_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
    missing = str(tmp_path / "missing")
    assert console.run_command("dflash-eval", ["--draft", missing, "--target", missing, "--data", missing]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dflash-eval: error: --draft '{missing}' does not exist") and "Traceback" not in err
    assert console.run_command("dflash-demo", ["--config", missing]) == 2
    assert f"dflash-demo: error: --config {missing} does not exist" in capsys.readouterr().err
    assert set(console.COMMANDS) == {"dflash-train", "dflash-eval", "dflash-generate-labels", "dflash-demo"}
    scripts = (REPO_ROOT / "pyproject.toml").read_text()
    for prog, function in (
        ("dflash-train", "train"),
        ("dflash-eval", "evaluate"),
        ("dflash-generate-labels", "generate_labels"),
        ("dflash-demo", "demo"),
    ):
        assert f'{prog} = "dflash_hf.cli.console:{function}"' in scripts


@pytest.mark.slow  # a fresh interpreter per command: up to ~11 s
@pytest.mark.parametrize(
    "module", ["dflash_hf.cli.train", "dflash_hf.cli.eval", "dflash_hf.cli.generate_labels", "dflash_hf.cli.demo"]
)
def test_python_dash_m_runs_the_command(module):
    """`python -m MODULE` (how benchmarks and devices without console scripts run them) must run the command:
    an unknown option is an argument error (exit 2), not a silent exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--no_such_option_xyz"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])


def test_early_stopping_without_a_reported_metric_is_refused_before_the_target_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
    import dflash_hf.targets.builder

    monkeypatch.setattr(dflash_hf.targets.builder, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    for name in ("train.json", "dev.json"):
        (tmp_path / name).write_text("")
    (tmp_path / "target").mkdir()
    argv = [
        "--target_name_or_path",
        str(tmp_path / "target"),
        "--train_data",
        str(tmp_path / "train.json"),
        "--eval_data",
        f"dev={tmp_path / 'dev.json'}",
        "--mask_token_id",
        "5",
        "--output_dir",
        str(tmp_path / "out"),
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "50",
        "--early_stopping_patience",
        "3",
        "--use_cpu",
        "true",
    ]
    assert console.run_command("dflash-train", argv) == 2
    err = capsys.readouterr().err
    assert "--early_stopping_patience: --metric_for_best_model must name a metric" in err and "dev_tau_est" in err
    assert console.run_command("dflash-train", [*argv, "--metric_for_best_model", "test_tau_est"]) == 2
    assert "got 'test_tau_est'" in capsys.readouterr().err


def test_yaml_python_tags_are_refused_as_a_user_error_before_torch_loads(tmp_path):
    """Before: a `!!python/...` tag was a raw yaml ConstructorError traceback."""
    marker = tmp_path / "ran"
    config = tmp_path / "c.yaml"
    config.write_text(f'seed: !!python/object/apply:os.system ["touch {marker}"]\n')
    code = (
        "import sys\n"
        "from dflash_hf.cli.console import run_command\n"
        f"print('rc', run_command('dflash-train', ['--config', {str(config)!r}]))\n"
        "print('torch' in sys.modules)\n"
    )
    out = _run(code)
    assert out.stdout.split() == ["rc", "2", "False"], out.stderr
    assert f"--config {config} line 1: could not determine a constructor for the tag" in out.stderr
    assert "not Python objects (`!!python/...` tags): remove the tag" in out.stderr and "Traceback" not in out.stderr
    assert not marker.exists()


def _preflight_argv(tmp_path: Path, target: Path, *extra: str) -> list[str]:
    (tmp_path / "train.jsonl").write_text("")
    argv = ["--target_name_or_path", str(target), "--train_data", str(tmp_path / "train.jsonl")]
    return [*argv, "--mask_token_id", "5", "--output_dir", str(tmp_path / "out"), "--use_cpu", "true", *extra]


def test_a_target_with_its_own_code_is_refused_unless_trusted(tmp_path, monkeypatch, capsys):
    """Before: a config with an auto_map was loaded (or crashed) without asking."""
    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
    from dflash_hf.targets.frozen import load_target

    target = tmp_path / "target"
    target.mkdir()
    config = {"model_type": "qwen3", "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}
    (target / "config.json").write_text(json.dumps(config))
    assert console.run_command("dflash-train", _preflight_argv(tmp_path, target)) == 2
    err = capsys.readouterr().err
    assert "its config.json has an auto_map (AutoModelForCausalLM)" in err and "--trust_remote_code true" in err
    with pytest.raises(ValueError, match="has an auto_map"):
        load_target(str(target))
    (target / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (target / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["tok.T", None]}}))
    assert console.run_command("dflash-train", _preflight_argv(tmp_path, target)) == 2
    assert "its tokenizer_config.json has an auto_map (AutoTokenizer)" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["export_dir", "output_dir"])
def test_a_run_writing_into_the_target_is_refused_before_the_target_loads(tmp_path, monkeypatch, capsys, where):
    """Before: `--export_dir` set to the target's directory wrote the draft over the target, exit 0."""
    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
    import dflash_hf.targets.builder

    monkeypatch.setattr(dflash_hf.targets.builder, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    assert console.run_command("dflash-train", _preflight_argv(tmp_path, target, f"--{where}", str(target))) == 2
    assert f"--{where} {target} is the target's directory or inside it" in capsys.readouterr().err
    assert [p.name for p in target.iterdir()] == ["config.json"]


def test_missing_audio_in_the_validation_set_is_found_before_the_target_loads(tmp_path, monkeypatch, capsys):
    """Before: it was found at the first evaluation, after the training so far."""
    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
    import dflash_hf.targets.builder
    from dflash_hf.testing import tiny

    monkeypatch.setattr(dflash_hf.targets.builder, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    manifest = tiny.synthesize_speech(tmp_path / "speech", 2, seed=0)
    dev = tmp_path / "dev.jsonl"
    dev.write_text(json.dumps({"audio_filepath": "missing.wav", "duration": 1.0, "text": "yes"}) + "\n")
    (tmp_path / "target").mkdir()
    argv = ["--target_name_or_path", str(tmp_path / "target"), "--train_data", str(manifest)]
    argv += ["--eval_data", f"dev={dev}", "--mask_token_id", "5", "--output_dir", str(tmp_path / "out")]
    assert console.run_command("dflash-train", [*argv, "--use_cpu", "true"]) == 2
    err = capsys.readouterr().err
    assert f"({dev} line 1): field 'audio_filepath'" in err and "does not exist" in err


def test_a_damaged_checkpoint_given_by_path_is_refused_before_the_target_loads(tmp_path, monkeypatch, capsys):
    """Before: a pickle planted in a checkpoint was a raw UnpicklingError traceback once training started."""
    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
    from safetensors.torch import save_file

    import dflash_hf.targets.builder
    from dflash_hf.testing import tiny
    from dflash_hf.training.checkpoints import COMPLETE_MARKER

    monkeypatch.setattr(dflash_hf.targets.builder, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    checkpoint = tmp_path / "out" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, checkpoint / "model.safetensors")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    (checkpoint / COMPLETE_MARKER).write_text("{}")
    planted = tmp_path / "planted"
    torch.save({"state": _Planted(str(planted))}, checkpoint / "optimizer.pt")
    manifest = tiny.synthesize_speech(tmp_path / "speech", 2, seed=0)
    (tmp_path / "target").mkdir()
    argv = ["--target_name_or_path", str(tmp_path / "target"), "--train_data", str(manifest), "--mask_token_id", "5"]
    argv += ["--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--resume_from_checkpoint", str(checkpoint)]
    assert console.run_command("dflash-train", argv) == 2
    err = capsys.readouterr().err
    assert f"--resume_from_checkpoint '{checkpoint}' is damaged: optimizer.pt holds pickled objects" in err
    assert not planted.exists()


class _Planted:
    """Unpickling it would create a directory (what a planted pickle could do)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_a_stop_signal_during_the_demo_is_one_line_and_exit_128_plus_signal(monkeypatch, capsys):
    import signal

    from dflash_hf.cli import demo
    from dflash_hf.training.step_guards import TrainingInterrupted

    def stopped(argv):
        raise TrainingInterrupted(signal.SIGTERM, 3, "runs/demo/checkpoint-3")

    monkeypatch.setattr(demo, "run", stopped)
    assert console.run_command("dflash-demo", []) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert err.startswith("dflash-demo: received SIGTERM: stopped at optimizer step 3") and "Traceback" not in err


@pytest.mark.parametrize(
    ("prog", "argv", "message"),
    [
        (
            "dflash-train",
            ["--mask_token", "5"],
            "--mask_token (options are not abbreviated); did you mean --mask_token_id?",
        ),
        ("dflash-train", ["--mask_tokn_id", "5"], "--mask_tokn_id; did you mean --mask_token_id?"),
        ("dflash-train", ["--conf", "x.yaml"], "--conf (options are not abbreviated); did you mean --config?"),
        ("dflash-eval", ["--max_new", "4"], "--max_new (options are not abbreviated); did you mean --max_new_tokens?"),
        ("dflash-generate-labels", ["--manifset=m.jsonl"], "--manifset; did you mean --manifest?"),
        ("dflash-demo", ["--max_step", "3"], "--max_step (options are not abbreviated); did you mean --max_steps?"),
    ],
)
def test_abbreviated_or_misspelled_options_are_refused_naming_the_closest(prog, argv, message, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [prog])  # the program name argparse prints, as a console script's
    with pytest.raises(SystemExit) as exit_info:  # refused by argparse, as any bad option: usage, message, status 2
        console.run_command(prog, argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith(f"\n{prog}: error: unknown option {message}\n")


def test_misspelled_or_abbreviated_config_keys_name_the_closest_field(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
    config = tmp_path / "run.yaml"
    config.write_text("mask_token: 5\nblock_sise: 8\n")
    assert console.run_command("dflash-train", ["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "unknown fields block_sise (line 2; did you mean block_size?)" in err
    assert "mask_token (line 1; did you mean mask_token_id?)" in err
