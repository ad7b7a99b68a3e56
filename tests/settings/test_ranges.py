"""Numeric options out of range, NaN or infinite are one clear error naming the option and its range, when the
arguments are parsed (the settings' `RANGES`, `dflash_hf/settings/`); transformers accepts every one of them."""

from __future__ import annotations

import math

import pytest
from utils import make_args

from dflash_hf.cli import console
from dflash_hf.settings import TRAINER_RANGES, TRAINING_SETTINGS, DataSettings, LoaderSettings, Range, range_problem
from dflash_hf.training.training_args import DFlashDataArguments

NAN, INF = float("nan"), float("inf")
TRAINING_CASES = [
    ("max_grad_norm", NAN, r"max_grad_norm must be >= 0 and finite \(0: no clipping\), got nan"),
    ("max_grad_norm", INF, "max_grad_norm must be >= 0 and finite"),
    ("max_grad_norm", -1.0, "max_grad_norm must be >= 0 and finite"),
    ("weight_decay", -0.01, r"weight_decay must be >= 0 and finite \(0: no weight decay\), got -0.01"),
    ("learning_rate", 0.0, "learning_rate must be > 0 and finite"),
    ("learning_rate", -1e-3, "learning_rate must be > 0 and finite"),
    ("learning_rate", NAN, "learning_rate must be > 0 and finite"),
    ("learning_rate", INF, "learning_rate must be > 0 and finite"),
    ("adam_beta1", 1.0, r"adam_beta1 must be in \[0, 1\), got 1.0"),
    ("adam_beta1", -0.1, r"adam_beta1 must be in \[0, 1\)"),
    ("adam_beta2", NAN, r"adam_beta2 must be in \[0, 1\)"),
    ("adam_epsilon", 0.0, "adam_epsilon must be > 0 and finite"),
    ("adam_epsilon", -1e-8, "adam_epsilon must be > 0 and finite"),
    ("warmup_steps", 1.5, "warmup_steps must be >= 0: a whole number of steps, or a fraction < 1 of them"),
    ("warmup_steps", NAN, "warmup_steps must be >= 0"),
    ("num_train_epochs", NAN, "num_train_epochs must be >= 0 and finite"),
    ("save_steps", 0, "save_steps must be > 0 and finite"),
    ("save_total_limit", 0, "save_total_limit must be >= 1 .or unset to keep every checkpoint."),
    ("per_device_train_batch_size", 0, "per_device_train_batch_size must be >= 1, got 0"),
    ("dataloader_num_workers", -1, "dataloader_num_workers must be >= 0"),
    ("seed", -1, r"seed must be in \[0, 4294967295\], got -1"),
    ("gamma", INF, "gamma must be > 0 and finite"),
    ("selector_loss_weight", NAN, "selector_loss_weight must be >= 0 and finite, got nan"),
    ("lora_alpha", NAN, "lora_alpha must be > 0 and finite"),
    ("lora_dropout", 1.0, r"lora_dropout must be in \[0, 1\)"),
    ("dpace_alpha", NAN, r"dpace_alpha must be in \(0, 1\]"),
    ("early_stopping_threshold", INF, "early_stopping_threshold must be >= 0 and finite"),
    ("max_train_minutes", NAN, "max_train_minutes must be a positive number of minutes"),
    ("skip_oom_batches", -1, "skip_oom_batches must be >= 0"),
    ("target_argmax_chunk_size", 0, "target_argmax_chunk_size must be > 0"),
    ("real_tau_samples", 0, "real_tau_samples must be >= 1"),
]
DATA_CASES = [
    ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
    ("max_batch_size", 0, r"max_batch_size must be >= 1 \(or unset\)"),
    ("num_buckets", 0, "num_buckets must be >= 1"),
    ("max_chars_per_second", -5.0, r"max_chars_per_second must be >= 0 and finite \(0: off\)"),
    ("max_chars_per_second", NAN, "max_chars_per_second must be >= 0 and finite"),
]


@pytest.mark.parametrize(("name", "value", "match"), TRAINING_CASES, ids=[f"{n}={v}" for n, v, _ in TRAINING_CASES])
def test_a_numeric_training_option_out_of_range_is_refused(tmp_path, name, value, match):
    with pytest.raises(ValueError, match=match):
        make_args(tmp_path, **{name: value})


@pytest.mark.parametrize(("name", "value", "match"), DATA_CASES, ids=[f"{n}={v}" for n, v, _ in DATA_CASES])
def test_a_numeric_data_option_out_of_range_is_refused(name, value, match):
    with pytest.raises(ValueError, match=match):
        DFlashDataArguments(**{name: value})


def test_sampling_weights_are_checked_one_by_one():
    with pytest.raises(ValueError, match=r"train_data_weights must be > 0 and finite .*, got \[1.0, nan\]"):
        DFlashDataArguments(train_data=["a", "b"], train_data_weights=[1.0, NAN])


def test_values_in_range_and_unset_options_pass(tmp_path):
    args = make_args(tmp_path, warmup_steps=0.1, max_grad_norm=0.0, weight_decay=0.0, adam_beta2=0.999, seed=2**32 - 1)
    assert args.warmup_steps == 0.1 and args.max_grad_norm == 0.0
    assert range_problem("x", None, Range(low=1)) is None  # unset
    assert range_problem("x", INF, Range(low=0, infinite_ok=True)) is None


def test_every_range_rule_refuses_nan():
    settings = (*TRAINING_SETTINGS, DataSettings, LoaderSettings)
    for name, rule in TRAINER_RANGES.items() | {(n, r) for cls in settings for n, r in cls.RANGES.items()}:
        assert not rule.holds(math.nan), name


def test_dflash_train_answers_a_nan_max_grad_norm_in_one_line_with_status_2(tmp_path, capsys):
    (tmp_path / "target").mkdir()
    argv = ["--target_name_or_path", str(tmp_path / "target"), "--train_data", __file__, "--max_grad_norm", "nan"]
    assert console.run_command("dflash-train", argv + ["--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "dflash-train: error: max_grad_norm must be >= 0 and finite (0: no clipping), got nan" in err
    assert "Traceback" not in err
