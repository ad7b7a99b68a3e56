"""Bad configuration: each case is a clear error naming the field or file and the fix, raised before the target
loads (docs/RELIABILITY.md, "Bad configuration and exported draft")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config
from utils import make_args, tiny_draft_config, tiny_text_target

from dflash_hf import DFlashConfig, DFlashDraftModel
from dflash_hf.cli import console
from dflash_hf.cli.config import parse_with_config
from dflash_hf.cli.train import make_parser, train
from dflash_hf.errors import USER_ERRORS, ConfigFileError, cli_message
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.targets.processor import check_model_dir
from dflash_hf.training.assembly import target_and_draft
from dflash_hf.training.training_args import DFlashDataArguments


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"gamma": 0.0}, r"gamma must be > 0"),
        ({"gamma": -2.0}, r"gamma must be > 0.*leave it unset"),
        ({"gamma": float("nan")}, r"gamma must be > 0"),
        ({"target_layer_ids": [1, 1, 2]}, r"target_layer_ids=\[1, 1, 2\] taps layers \[1\] more than once"),
        ({"target_layer_ids": [-1, 2]}, r"target_layer_ids \[-1\] out of range"),
        ({"num_draft_layers": 0}, r"num_draft_layers must be >= 1"),
        ({"block_size": 100000}, r"block_size must be an integer in \[2, 128\].*got 100000"),
        ({"block_size": 1}, r"block_size must be an integer in \[2, 128\]"),
        ({"anchor_pad_multiple": 0}, r"anchor_pad_multiple must be >= 1"),
        ({"ce_chunk_size": 0}, r"ce_chunk_size must be >= 1"),
        ({"attention_backend": "flex"}, r"attention_backend=flex trains on CUDA only.*use attention_backend=sdpa"),
    ],
)
def test_bad_training_arguments(tmp_path, fields, match):
    with pytest.raises(ValueError, match=match):
        make_args(tmp_path, **fields)


def test_recipe_gamma_still_defaults(tmp_path):
    assert make_args(tmp_path).gamma is None  # unset -> recipe default in the trainer, never `0 or default`


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "text, match",
    [
        (
            "num_anchors: 16\ntarget_layer_ids: 3\n",
            r"x.yaml line 2: target_layer_ids: 3 is an integer; "
            r"target_layer_ids takes a list, e.g. `target_layer_ids: \[3\]`",
        ),
        ("num_anchors: 8.5\n", r"x.yaml line 1: num_anchors: 8.5 is a number; give an integer"),
        ("use_cpu: 3\n", r"line 1: use_cpu: 3 is an integer; give true or false"),
        ("gamma: fast\n", r"line 1: gamma: 'fast' is not a valid number"),
        ("eval_strategy: no\n", r"line 1: eval_strategy: False is not one of no, steps, epoch \(YAML reads yes/no"),
        ("hub_model_id: off\n", r"line 1: hub_model_id: YAML read False as a boolean; quote the value"),
        ("variant: dflash3\n", r"line 1: variant: 'dflash3' is not one of dflash, dflash2"),
        ("target_layer_ids: [1, x]\n", r"target_layer_ids \(item 1\): 'x' is not a valid integer"),
        ("num_anchors: 8\nnum_anchors: 9\n", r"line 2: num_anchors is set twice \(first on line 1\)"),
        ("num_anchor: 8\n", r"unknown fields num_anchor \(line 1; did you mean num_anchors\?\)"),
        ("num_anchors: 8\n  bad: [\n", r"x.yaml: line 2, column \d+ is not valid YAML"),
        ("- 1\n- 2\n", r"must hold a mapping of `field: value` lines, got a YAML sequence"),
    ],
)
def test_bad_yaml_config(tmp_path, text, match):
    config = _write(tmp_path, "x.yaml", text)
    with pytest.raises(ConfigFileError, match=match):
        parse_with_config(make_parser(), ["--config", config, "--output_dir", str(tmp_path)])


def test_yaml_values_parse_as_on_the_command_line(tmp_path):
    config = _write(
        tmp_path,
        "ok.yaml",
        "target_layer_ids: [1, 3]\ngamma: 3\nlearning_rate: 1e-4\nuse_cpu: true\neval_strategy: 'no'\n"
        "lr_scheduler_kwargs: {min_lr: 1.0e-6}\nmax_steps: 5\n",
    )
    args, _ = parse_with_config(make_parser(), ["--config", config, "--output_dir", str(tmp_path), "--max_steps", "7"])
    assert args.target_layer_ids == [1, 3] and args.gamma == 3.0 and args.learning_rate == 1e-4
    assert args.use_cpu is True and args.eval_strategy == "no" and args.max_steps == 7  # the flag wins
    assert args.lr_scheduler_kwargs == {"min_lr": 1e-6}


def _export(tmp_path: Path, vocab_size: int = 40) -> Path:
    torch.manual_seed(0)
    config = tiny_draft_config(
        {"mask_token_id": 5, "target_layer_ids": [1, 2]},
        block_size=8,
        num_target_layers=4,
        hidden_size=64,
        head_dim=16,
        vocab_size=vocab_size,
    )
    out = tmp_path / "draft"
    DFlashDraftModel(config).save_pretrained(out)
    return out


def test_broken_warm_start_fails_before_the_target_loads(tmp_path):
    """Building the arguments reads no file; `check_files` (the CLI's pre-flight, and the trainer's first step)
    refuses a broken export and takes the block size left unset from a sound one."""
    export = _export(tmp_path)
    weights = export / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    args = make_args(tmp_path, init_from_pretrained=str(export), block_size=None)
    assert args.block_size is None
    with pytest.raises(ValueError, match=rf"{weights} is not a readable safetensors file.*truncated"):
        args.check_files()
    weights.write_bytes(data)
    args.check_files()
    assert args.block_size == 8
    (export / "config.json").write_text('{"architectures": ["DFlashDraftModel"],\n "block_size": 8,,}')
    with pytest.raises(ValueError, match=rf"{export / 'config.json'} is not valid JSON \(line 2"):
        make_args(tmp_path, init_from_pretrained=str(export)).check_files()


def test_warm_start_from_another_vocabulary_is_refused(tmp_path):
    model, tok = tiny_text_target(num_layers=4)
    export = _export(tmp_path, vocab_size=model.config.vocab_size + 3)
    args = make_args(tmp_path, init_from_pretrained=str(export), block_size=8)
    with pytest.raises(
        ValueError,
        match=rf"vocab_size {model.config.vocab_size + 3}, but this target's embedding "
        rf"has {model.config.vocab_size} rows",
    ):
        target_and_draft(FrozenTarget(model), args)


def test_missing_local_target_directory(tmp_path):
    def check_target_path(name):
        check_model_dir(name, "target_name_or_path", "the frozen target")

    missing = str(tmp_path / "no" / "target")
    with pytest.raises(FileNotFoundError, match=r"the directory does not exist"):
        check_target_path(missing)
    with pytest.raises(FileNotFoundError, match=r"directory does not exist"):
        check_target_path("./target")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        check_target_path(str(tmp_path / "file"))
    check_target_path(str(tmp_path))
    check_target_path("org/some-model")  # a Hub id: left to transformers
    with pytest.raises(FileNotFoundError, match="directory does not exist"):  # in train(), before any loading
        train(make_args(tmp_path, target_name_or_path=missing), DFlashDataArguments())


def test_draft_config_says_what_the_draft_computes():
    target = Qwen3Config(
        num_hidden_layers=6,
        hidden_size=64,
        num_attention_heads=4,
        hidden_act="gelu",
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )
    config = DFlashConfig.from_target_config(target, mask_token_id=3, num_hidden_layers=2)
    assert config.hidden_act == "silu"
    assert config.to_dict()["rope_theta"] == 5e5 == config.to_dict()["rope_parameters"]["rope_theta"]
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act='gelu': the draft MLP is SwiGLU with 'silu'"):
        config.validate_dflash()
    with pytest.raises(ValueError, match="num_draft_layers"):
        DFlashConfig.from_target_config(target, mask_token_id=3, num_hidden_layers=0)
    with pytest.raises(ValueError, match=r"taps layers \[2\] more than once"):
        DFlashConfig.from_target_config(target, mask_token_id=3, target_layer_ids=[2, 2])


def test_cli_message_speaks_flags():
    names = ["skip_bad_samples", "packing", "attention_backend", "target_name_or_path"]
    assert cli_message("x (or pass skip_bad_samples=True to skip such samples)", names) == (
        "x (or pass --skip_bad_samples true to skip such samples)"
    )
    assert cli_message("packing=true needs; use attention_backend='sdpa'.", names) == (
        "--packing true needs; use --attention_backend sdpa."
    )
    assert cli_message("card_info.tau=2 and other_field=3", names) == "card_info.tau=2 and other_field=3"


def test_console_user_error_is_one_message_and_status_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DFLASH_DEBUG", raising=False)
    data = _write(tmp_path, "train.jsonl", "")
    (tmp_path / "target").mkdir()
    argv = ["--output_dir", str(tmp_path / "out"), "--target_name_or_path", str(tmp_path / "target")]
    argv += ["--train_data", data]
    argv += ["--gamma", "0"]
    assert console.run_command("dflash-train", argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-train: error: gamma must be > 0") and "Traceback" not in err
    assert "DFLASH_DEBUG=1" in err
    config = _write(tmp_path, "c.yaml", "skip_bad_samples: maybe\n")
    assert console.run_command("dflash-train", ["--config", config]) == 2
    assert "c.yaml line 1: skip_bad_samples: 'maybe' is not a valid boolean (true or false)" in capsys.readouterr().err
    monkeypatch.setenv("DFLASH_DEBUG", "1")
    with pytest.raises(ValueError, match="gamma"):
        console.run_command("dflash-train", argv)


def test_bugs_are_not_user_errors():
    assert not issubclass(RuntimeError, USER_ERRORS) and not issubclass(KeyError, USER_ERRORS)
    assert issubclass(ConfigFileError, ValueError)
    from dflash_hf.data.bad_samples import BadSampleError

    assert issubclass(BadSampleError, USER_ERRORS)


def test_exported_config_json_has_top_level_rope_theta(tmp_path):
    export = _export(tmp_path)
    raw = json.loads((export / "config.json").read_text())
    assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"]


def test_run_inputs_are_required(tmp_path):
    from types import SimpleNamespace

    from dflash_hf.training.run_inputs import check_run_inputs

    def ns(**kw):
        return SimpleNamespace(
            **(
                {"target_name_or_path": str(tmp_path), "validate_only": False, "train_data": None, "eval_data": None}
                | kw
            )
        )

    with pytest.raises(ValueError, match="--target_name_or_path is required"):
        check_run_inputs(ns(target_name_or_path=None), ns())
    with pytest.raises(ValueError, match="--train_data is required"):
        check_run_inputs(ns(), ns())
    with pytest.raises(ValueError, match="--validate_only true needs --eval_data"):
        check_run_inputs(ns(validate_only=True), ns())
    (tmp_path / "t.jsonl").write_text("")
    check_run_inputs(ns(), ns(train_data=[str(tmp_path / "t.jsonl")]))


def test_gradient_accumulation_steps_below_one_is_refused(tmp_path):
    """Before: `--gradient_accumulation_steps 0` trained until a ZeroDivisionError inside the Trainer."""
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be >= 1, got 0"):
        make_args(tmp_path, gradient_accumulation_steps=0)


def test_an_fsdp_launch_without_a_gpu_is_refused_instead_of_training_ddp(tmp_path, monkeypatch):
    """Before: `accelerate launch --config_file examples/accelerate/fsdp2.yaml` on a CPU machine trained DDP."""
    from dflash_hf.training import launch

    monkeypatch.setattr(launch, "has_accelerator", lambda: False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what accelerate exports for an FSDP config
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(ValueError, match=r"FSDP accelerate config .* without a GPU.*would train with DDP instead"):
        make_args(tmp_path, use_cpu=False)
