"""Environment faults in training (docs/RELIABILITY.md, "Environment faults"): GPU out of memory injected as
`torch.OutOfMemoryError` on the CPU (stop with a checkpoint at the step boundary, or skip with
`--skip_oom_batches`), a full disk through the console script. The real CUDA out-of-memory is in
tests/gpu/test_env_faults_gpu.py; the real killed loader worker in tests/training/test_faults.py."""

from __future__ import annotations

import errno
import json
import signal
from pathlib import Path

import pytest
import torch
from utils import (
    assert_bitwise_equal,
    make_args,
    make_trainer,
    random_rows,
    tiny_text_target,
    trainer_weights,
)

from dflash_hf import DFlashTrainer
from dflash_hf.errors import ENVIRONMENT_FAULT_EXIT_CODE, EnvironmentFault
from dflash_hf.testing import tiny
from dflash_hf.training.checkpoints import COMPLETE_MARKER, last_complete_checkpoint
from dflash_hf.training.env_faults import SKIPPED_KEY
from dflash_hf.training.training_args import DFlashDataArguments


def out_of_memory_at(monkeypatch, *calls: int) -> list[int]:
    """Make the training `compute_loss` calls numbered `calls` (1-based) raise `torch.OutOfMemoryError`."""
    real, seen = DFlashTrainer.compute_loss, []

    def compute_loss(self, model, inputs, *args, **kwargs):
        if model.training:
            seen.append(len(seen) + 1)
            if seen[-1] in calls:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(DFlashTrainer, "compute_loss", compute_loss)
    return seen


def speech_trainer(root: Path, name: str, asr, **kw) -> DFlashTrainer:
    """12 utterances at max_tokens 600: 6 micro-batches per data epoch; gradient accumulation 2."""
    model, processor, manifest = asr
    base = dict(mask_token_id=262, max_steps=4, gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1)
    args = make_args(root / name, **(base | kw))
    data_args = DFlashDataArguments(max_tokens=600, prompt="Transcribe.")
    return DFlashTrainer(
        args=args, target=model, processor=processor, data_args=data_args, train_dataset=[str(manifest)]
    )


@pytest.fixture(scope="module")
def asr(tmp_path_factory):
    root = tmp_path_factory.mktemp("asr")
    tok = tiny.build_tokenizer()
    model, processor = tiny.build_qwen3_asr_target(tok, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)
    tiny.synthesize_speech(root / "speech", 12, seed=0)
    return model, processor, root / "speech" / "manifest.jsonl"


def test_out_of_memory_mid_step_saves_the_step_boundary_and_the_resume_is_bit_exact(tmp_path, asr, monkeypatch):
    """Out of memory in micro-batch 2 of step 3: the checkpoint at step 2 holds the data position of the step's
    start (micro-batch 1 of step 3 handed out again on resume): the resumed run ends bit for bit as an uninterrupted
    one."""
    straight = speech_trainer(tmp_path, "a", asr)
    straight.train()

    out_of_memory_at(monkeypatch, 6)  # micro-batches 1-4 are steps 1-2; 6 is the second of step 3
    faulted = speech_trainer(tmp_path, "b", asr)
    with pytest.raises(EnvironmentFault) as info:
        faulted.train()
    fault, checkpoint = info.value, tmp_path / "b" / "out" / "checkpoint-2"
    assert fault.saved and fault.checkpoint == str(checkpoint) and (checkpoint / COMPLETE_MARKER).is_file()
    text = str(fault)
    assert text.startswith("GPU out of memory in optimizer step 3, micro-batch 2 of 2: ")
    assert "rows, " in text and " tokens, " in text
    assert " anchors of block size 4 (CUDA out of memory. Tried to allocate 2.00 GiB (injected))." in text
    for option in ("--max_tokens (now 600", "--num_anchors (now 64", "--ce_chunk_size", "--skip_oom_batches N"):
        assert option in text, option
    assert f"A complete checkpoint was saved where the run stopped: {checkpoint}" in text
    position = json.loads((checkpoint / "dflash_data_state_rank0.json").read_text())
    assert (position["epoch"], position["batches_consumed"]) == (0, 4)  # not 5: the failed step's start

    monkeypatch.undo()
    resumed = speech_trainer(tmp_path, "b", asr)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    assert_bitwise_equal(trainer_weights(straight), trainer_weights(resumed))


def _text_trainer(tmp_path, **kw) -> DFlashTrainer:
    model, tok = tiny_text_target()
    base = dict(per_device_train_batch_size=2, logging_steps=1, learning_rate=1e-3, max_steps=4)
    return make_trainer(tmp_path, model, tok, random_rows(4, 250, seed=1), **(base | kw))


class _Weights:
    """Records the draft's weights after every optimizer step."""

    def __init__(self, trainer: DFlashTrainer):
        from transformers import TrainerCallback

        self.by_step: dict[int, dict] = {}
        outer = self

        class Record(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                outer.by_step[state.global_step] = trainer_weights(trainer)

        trainer.add_callback(Record())


def test_skip_oom_batches_skips_the_step_without_an_update_and_counts_it(tmp_path, monkeypatch):
    out_of_memory_at(monkeypatch, 2)  # step 2 (one micro-batch a step)
    trainer = _text_trainer(tmp_path, skip_oom_batches=1, save_strategy="steps", save_steps=1)
    weights = _Weights(trainer)
    trainer.train()
    assert trainer.state.global_step == 4
    assert_bitwise_equal(weights.by_step[1], weights.by_step[2])  # the optimizer did not update at step 2
    assert not torch.equal(weights.by_step[2]["fc.weight"], weights.by_step[3]["fc.weight"])  # step 3 did
    state = trainer.optimizer.state[next(p for p in trainer.model.parameters() if p.requires_grad)]
    assert int(state["step"]) == 3  # three updates in four steps
    logs = {h["step"]: h for h in trainer.state.log_history if "learning_rate" in h}
    assert [logs[s][SKIPPED_KEY] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert "loss" not in logs[2] and "loss" in logs[3]  # the skipped step trained nothing: no loss of 0 logged
    skipped = trainer.step_faults.skipped
    assert [s["step"] for s in skipped] == [2] and "micro-batch 1 of 1: 2 rows" in skipped[0]["micro_batch"]
    record = json.loads((tmp_path / "out" / "checkpoint-4" / "dflash_run.json").read_text())
    assert record[SKIPPED_KEY] == skipped  # kept in every checkpoint: restored on resume
    assert trainer.step_faults.summary().startswith("skipped 1 optimizer steps that ran out of GPU memory: step 2")


def test_out_of_memory_beyond_skip_oom_batches_stops_with_the_message(tmp_path, monkeypatch):
    out_of_memory_at(monkeypatch, 1, 3)
    trainer = _text_trainer(tmp_path, skip_oom_batches=1)
    with pytest.raises(EnvironmentFault, match=r"1 steps were skipped already, as many as --skip_oom_batches 1") as e:
        trainer.train()
    assert "--per_device_train_batch_size (now 2)" in str(e.value)
    assert e.value.saved and e.value.checkpoint.endswith("checkpoint-2")  # the boundary before step 3


def test_skip_oom_batches_needs_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="skip_oom_batches=1 needs a single process .*WORLD_SIZE=2"):
        make_args(tmp_path, skip_oom_batches=1)


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1472 vs 1360"),
    ],
)
def test_full_disk_in_dflash_train_is_one_line_exit_75_with_the_resume_command(tmp_path, monkeypatch, capsys, error):
    from dflash_hf.cli import console

    root = tmp_path
    tiny.save_tiny_target(root / "target", hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)
    tiny.synthesize_speech(root / "speech", 4, seed=0)
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if "checkpoint-2" in str(f):
            raise error
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    out = root / "out"
    argv = [
        "--target_name_or_path", str(root / "target"), "--train_data", str(root / "speech" / "manifest.jsonl"),
        "--mask_token_id", "262", "--output_dir", str(out), "--max_steps", "3", "--save_strategy", "steps",
        "--save_steps", "1", "--use_cpu", "true", "--block_size", "4", "--num_draft_layers", "1", "--num_anchors",
        "8", "--max_tokens", "600", "--prompt", "Transcribe.", "--label_source", "ground_truth",
        "--attention_backend", "sdpa", "--report_to", "none", "--disable_tqdm", "true",
    ]  # fmt: skip
    assert console.run_command("dflash-train", argv) == ENVIRONMENT_FAULT_EXIT_CODE == 75
    err = capsys.readouterr().err
    assert "Traceback" not in err
    message = next(line for line in err.splitlines() if line.startswith("dflash-train: stopped: "))
    assert f"no space left on device while writing {out / 'checkpoint-2'}" in message
    assert f"The last complete checkpoint is {out / 'checkpoint-1'} (the steps after it are lost)" in message
    assert message.endswith("--disable_tqdm true --resume_from_checkpoint true`")
    assert last_complete_checkpoint(out)[0] == out / "checkpoint-1"


def test_full_disk_while_exporting_names_the_export_directory_and_the_last_checkpoint(tmp_path, monkeypatch):
    import dflash_hf.training.draft_export as draft_export
    from dflash_hf.training.checkpoints import DiskFullError

    trainer = _text_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    trainer.train()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(draft_export, "export_draft", full)
    with pytest.raises(DiskFullError, match=r"while writing .*draft .*set export_dir on a larger disk") as e:
        trainer.export_draft()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert e.value.errno == errno.ENOSPC and e.value.checkpoint == str(checkpoint) and e.value.ended
    assert (
        f"The unfinished export is never used. Training had ended and its last step is the complete checkpoint "
        f"{checkpoint}; resume from it (no step is trained again: the final evaluation and the export run)"
    ) in str(e.value)


def test_a_fault_is_one_line_and_status_75_and_its_traceback_only_with_dflash_debug(monkeypatch, capsys):
    from dflash_hf.errors import DEBUG_ENV, run_console

    def stopped(argv):
        fault = EnvironmentFault("a data-loader worker died (injected)", checkpoint="runs/x/checkpoint-7", saved=True)
        fault.resume_command = "`dflash-train --output_dir runs/x --resume_from_checkpoint true`"
        raise fault

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert run_console(stopped, [], prog="dflash-train") == 75
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (
        "dflash-train: stopped: a data-loader worker died (injected). A complete checkpoint was saved where the run "
        "stopped: runs/x/checkpoint-7; resume from it: `dflash-train --output_dir runs/x --resume_from_checkpoint true`"
    )
    assert "Traceback" not in err
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(EnvironmentFault):
        run_console(stopped, [], prog="dflash-train")


def test_the_resume_command_replaces_a_resume_option_given(monkeypatch):
    from dflash_hf.cli.train import resume_command

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["--config", "a b.yaml", "--resume_from_checkpoint", "runs/x/checkpoint-3", "--resume_from_checkpoint=auto"]
    assert resume_command(argv) == "`dflash-train --config 'a b.yaml' --resume_from_checkpoint true`"
    assert resume_command(["--max_steps", "9"], resume=False) == "`dflash-train --max_steps 9`"  # nothing saved yet
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resume_command([]).endswith("` (through the same launcher as this run)")


def test_a_skipped_step_under_gradient_accumulation_drops_the_whole_step(tmp_path, monkeypatch):
    """Out of memory in micro-batch 1 of step 2 (of 2): its gradients are dropped, micro-batch 2 is not run, the
    optimizer does not update; step 3 trains normally."""
    seen = out_of_memory_at(monkeypatch, 3)
    trainer = _text_trainer(
        tmp_path, skip_oom_batches=1, per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=3
    )
    weights = _Weights(trainer)
    trainer.train()
    assert len(seen) == 5  # 6 micro-batches: the second of step 2 never reached the loss
    assert_bitwise_equal(weights.by_step[1], weights.by_step[2])
    assert not torch.equal(weights.by_step[2]["fc.weight"], weights.by_step[3]["fc.weight"])
    state = trainer.optimizer.state[next(p for p in trainer.model.parameters() if p.requires_grad)]
    assert int(state["step"]) == 2 and trainer.step_faults.skipped[0]["micro_batch"].startswith("micro-batch 1 of 2")


def _best_loaded_trainer(tmp_path) -> DFlashTrainer:
    """4 steps evaluated each step, only the best (highest loss: step 1) saved and loaded at the end."""
    model, tok = tiny_text_target()
    rows = random_rows(4, 250, seed=1)
    return make_trainer(
        tmp_path, model, tok, rows, eval_rows=rows, per_device_train_batch_size=2, learning_rate=1e-3, max_steps=4,
        eval_strategy="steps", eval_steps=1, save_strategy="best", load_best_model_at_end=True,
        metric_for_best_model="loss", greater_is_better=True,
    )  # fmt: skip


def test_a_fault_after_the_best_checkpoint_was_loaded_names_the_last_steps_checkpoint(tmp_path):
    """Out of memory in the final evaluation, the best step's weights loaded: nothing is saved then (a checkpoint now
    would hold them with the last step's optimizer and step count). The last step was saved before the best
    checkpoint was loaded; a resume from it trains no step and loads the best checkpoint again."""
    trainer = _best_loaded_trainer(tmp_path)
    trainer.train()
    assert (trainer.state.best_global_step, trainer.state.global_step) == (1, 4)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-4"]

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected)")

    trainer.evaluate = out_of_memory
    with pytest.raises(EnvironmentFault) as info:
        trainer.final_eval_metrics()
    assert info.value.ended and info.value.checkpoint == str(out / "checkpoint-4")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-4"]

    resumed = _best_loaded_trainer(tmp_path)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.trains_no_step and resumed.state.global_step == 4
    assert_bitwise_equal(trainer_weights(trainer), trainer_weights(resumed))  # the best checkpoint's draft


def test_a_stop_signal_after_the_best_checkpoint_was_loaded_names_the_last_steps_checkpoint(tmp_path):
    """SIGTERM during the end of training, after `load_best_model_at_end` loaded step 1: no checkpoint of step 1's
    weights is written at step 4; the message names checkpoint-4, saved before the best checkpoint was loaded."""
    from transformers import TrainerCallback

    from dflash_hf.training.step_guards import TrainingInterrupted

    trainer = _best_loaded_trainer(tmp_path)

    class SignalAtEnd(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            trainer.stop_signals.signum = signal.SIGTERM  # as its handler records it

    trainer.add_callback(SignalAtEnd())
    with pytest.raises(TrainingInterrupted, match=r"stopped at optimizer step 4, saved .*checkpoint-4;"):
        trainer.train()
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-4"]
