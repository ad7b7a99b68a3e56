"""What follows training's last step (dflash_hf/training/training_end.py; docs/RELIABILITY.md, "Environment faults"):
the last step is saved once, whatever the save strategy but `no`; a resume from a checkpoint at which training ended
trains no step; a fault in the final evaluation or the export names that checkpoint, and the resume from it ends with
the uninterrupted run's export and final metrics."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.trainer_callback import TrainerState
from utils import (
    assert_bitwise_equal,
    dflash_train_in_process,
    link_assets,
    make_trainer,
    random_rows,
    tiny_text_target,
    trainer_weights,
)

from dflash_hf import DFlashTrainer
from dflash_hf.errors import ENVIRONMENT_FAULT_EXIT_CODE
from dflash_hf.testing import tiny
from dflash_hf.training.best_model import ResumableEarlyStopping
from dflash_hf.training.training_end import training_ended


def counted(monkeypatch, name: str) -> list[int]:
    """The `global_step` at each call of `DFlashTrainer.<name>` (`training_step`: once per micro-batch)."""
    real, calls = getattr(DFlashTrainer, name), []

    def wrapper(self, *args, **kwargs):
        calls.append(self.state.global_step)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DFlashTrainer, name, wrapper)
    return calls


def text_trainer(root: Path, **kw) -> DFlashTrainer:
    """4 rows, 2 a step: 2 optimizer steps per epoch; one unnamed validation set (the training rows)."""
    model, tok = tiny_text_target()
    rows = random_rows(4, 250, seed=1)
    base = dict(per_device_train_batch_size=2, learning_rate=1e-3)
    return make_trainer(root, model, tok, rows, eval_rows=rows, **(base | kw))


BEST = dict(eval_strategy="steps", eval_steps=1, metric_for_best_model="loss", greater_is_better=True)


@pytest.mark.parametrize(
    ("kw", "saved"),
    [
        (dict(save_strategy="steps", save_steps=2, max_steps=3), [2, 3]),  # transformers saves the last step itself
        (dict(save_strategy="best", max_steps=3, **BEST), [1, 3]),  # step 1 is the best (the loss only falls)
        (dict(save_strategy="steps", save_steps=4, max_steps=10, early_stopping_patience=1, **BEST), [2]),
        (dict(save_strategy="no", max_steps=3), []),
    ],
    ids=["steps", "best", "early_stopping", "no"],
)
@pytest.mark.compat  # the end of transformers' loop (`_finalize_training`)
def test_the_last_step_is_saved_once_unless_saving_is_off(tmp_path, monkeypatch, kw, saved):
    saves = counted(monkeypatch, "_save_checkpoint")
    trainer = text_trainer(tmp_path, **kw)
    trainer.train()
    assert saves == saved  # each step once: no second save of the last one
    assert sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*")) == saved


@pytest.mark.compat  # transformers' resume (`_init_training_state`)
def test_a_resume_from_the_last_step_trains_no_step(tmp_path, monkeypatch):
    """max_steps 3 with 2 steps an epoch: transformers' loop, resumed at step 3, would train a step 4."""
    straight = text_trainer(tmp_path, save_strategy="steps", save_steps=2, max_steps=3)
    straight.train()
    steps = counted(monkeypatch, "training_step")
    resumed = text_trainer(tmp_path, save_strategy="steps", save_steps=2, max_steps=3)
    result = resumed.train(resume_from_checkpoint=True)
    assert steps == [] and resumed.trains_no_step and resumed.state.global_step == 3
    assert "train_loss" not in result.metrics  # not transformers' 0.0: no step, no loss
    assert "train_loss" not in resumed.state.log_history[-1] and "train_runtime" in resumed.state.log_history[-1]
    assert_bitwise_equal(trainer_weights(straight), trainer_weights(resumed))


def test_training_ended_at_max_steps_or_used_up_patience_not_at_a_time_budget():
    state = TrainerState(global_step=3, max_steps=3)
    assert training_ended(state, 3, None) and not training_ended(state, 5, None)  # a larger max_steps trains on
    state.stateful_callbacks = {
        ResumableEarlyStopping.__name__: {"attributes": {"early_stopping_patience_counter": 2}, "args": {}}
    }
    assert training_ended(state, 5, 2) and not training_ended(state, 5, 3)  # a larger patience trains on
    state = TrainerState(global_step=2, max_steps=5)  # stopped by max_train_minutes or a stop signal
    assert not training_ended(state, 5, None)


# --------------------------------------------------------------------------------- through dflash-train
def dflash_train_argv(root: Path) -> list[str]:
    """3 steps (2 a data epoch), a checkpoint every 2 steps and at most one kept, a final evaluation on `dev`."""
    return [
        "--target_name_or_path", str(root / "target"), "--train_data", str(root / "speech" / "manifest.jsonl"),
        "--eval_data", f"dev={root / 'speech' / 'manifest.jsonl'}", "--mask_token_id", "262", "--output_dir",
        str(root / "out"), "--max_steps", "3", "--save_strategy", "steps", "--save_steps", "2",
        "--save_total_limit", "1", "--learning_rate", "1e-3", "--use_cpu", "true", "--block_size", "4",
        "--num_draft_layers", "1", "--num_anchors", "8", "--max_tokens", "600", "--prompt", "Transcribe.",
        "--label_source", "ground_truth", "--attention_backend", "sdpa", "--report_to", "none",
        "--disable_tqdm", "true",
    ]  # fmt: skip


def dflash_train(root: Path, *extra: str) -> dict:
    return dflash_train_in_process(dflash_train_argv(root) + list(extra))


def faulted_dflash_train(root: Path, capsys, *extra: str) -> str:
    """`dflash-train` that stops on an environment fault: its one line."""
    from dflash_hf.cli import console

    assert console.run_command("dflash-train", dflash_train_argv(root) + list(extra)) == ENVIRONMENT_FAULT_EXIT_CODE
    return next(line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash-train: stopped: "))


def final_metrics(metrics: dict) -> dict:
    """The metrics a run reports of its draft (not its timings)."""
    return {k: v for k, v in metrics.items() if not any(w in k for w in ("runtime", "per_second", "minutes"))}


@pytest.mark.slow  # four dflash-train runs on a tiny target: 4-6 s on 2 busy cores
def test_faults_in_the_final_evaluation_and_the_export_resume_without_training_to_the_same_export(
    tmp_path_factory, monkeypatch, capsys
):
    """Out of memory in the final evaluation, resumed; then a full disk while exporting, resumed: each resume trains
    no step, and the last one ends with the uninterrupted run's export, byte for byte, and its final metrics."""
    import dflash_hf.training.draft_export as draft_export

    assets = tmp_path_factory.mktemp("assets")
    tiny.save_tiny_target(assets / "target", hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)
    tiny.synthesize_speech(assets / "speech", 4, seed=0)
    runs = tmp_path_factory.mktemp("runs")
    roots = {name: link_assets(assets, runs / name) for name in ("straight", "faulted")}
    reference = dflash_train(roots["straight"])

    root, out = roots["faulted"], roots["faulted"] / "out"
    steps = counted(monkeypatch, "training_step")
    evaluate = DFlashTrainer.evaluate

    def out_of_memory(self, eval_dataset=None, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected)")

    monkeypatch.setattr(DFlashTrainer, "evaluate", out_of_memory)
    message = faulted_dflash_train(root, capsys)
    assert steps == [0, 1, 2] and message.startswith("dflash-train: stopped: GPU out of memory after optimizer step 3")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]  # save_total_limit 1 kept
    ended = (
        f"Training had ended and its last step is the complete checkpoint {out / 'checkpoint-3'}; resume from it (no "
        "step is trained again: the final evaluation and the export run): `dflash-train "
    )
    assert ended in message and message.endswith(" --resume_from_checkpoint true`")

    monkeypatch.setattr(DFlashTrainer, "evaluate", evaluate)
    export_draft = draft_export.export_draft

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(draft_export, "export_draft", full_disk)
    message = faulted_dflash_train(root, capsys, "--resume_from_checkpoint", "true")
    assert steps == [0, 1, 2] and f"no space left on device while writing {out / 'draft'}" in message
    assert ended in message

    monkeypatch.setattr(draft_export, "export_draft", export_draft)
    metrics = dflash_train(root, "--resume_from_checkpoint", "true")
    assert steps == [0, 1, 2] and metrics["global_step"] == 3 and "train_loss" not in metrics
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    straight, resumed = roots["straight"] / "out" / "draft", out / "draft"
    assert_bitwise_equal(load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors"))
    assert (straight / "model.safetensors").read_bytes() == (resumed / "model.safetensors").read_bytes()
    assert "eval_dev_loss" in metrics
    expected = {k: v for k, v in final_metrics(reference).items() if k != "train_loss"}
    assert final_metrics(metrics) == expected  # the final evaluation's metrics, epoch, steps, skipped samples
