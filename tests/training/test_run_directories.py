"""A run directory belongs to one run; a resume refuses changed settings; damaged checkpoints, non-finite steps and
directories a run must not write over are clear errors (docs/RELIABILITY.md, "Run directories, resume and faults")."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback
from utils import make_trainer, random_rows, tiny_text_target, trainer_weights

from dflash_hf.errors import DFlashUserError
from dflash_hf.export.run_record import RUN_RECORD, RunDirectoryError
from dflash_hf.training.checkpoints import resolve_resume_checkpoint
from dflash_hf.training.run_identity import check_run_directories
from dflash_hf.training.step_guards import NonFiniteStepError

ROWS = random_rows(8, 250, seed=3)


@pytest.fixture(scope="module")
def text_target():
    return tiny_text_target()


def _trainer(root: Path, target, **kw):
    model, tok = target
    base = dict(max_steps=4, save_strategy="steps", save_steps=2, learning_rate=1e-3, num_draft_layers=1)
    return make_trainer(root, model, tok, ROWS, **(base | kw))


def _record(directory: Path) -> dict:
    return json.loads((directory / RUN_RECORD).read_text())


def test_a_new_run_refuses_a_directory_holding_another_run_unless_overwrite(tmp_path, text_target):
    first = _trainer(tmp_path, text_target)
    first.train()
    first.export_draft()
    out = tmp_path / "out"
    first.save_state()  # the whole log, as dflash-train saves it at the end
    run_id = _record(out)["run_id"]
    assert _record(out / "checkpoint-4")["run_id"] == _record(out / "draft")["run_id"] == run_id
    with pytest.raises(RunDirectoryError, match=rf"belongs to another run \(run {run_id}: checkpoint-2, checkpoint-4"):
        _trainer(tmp_path, text_target).train()
    second = _trainer(tmp_path, text_target, max_steps=2, overwrite_output_dir=True)
    second.train()
    assert _record(out)["run_id"] != run_id
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", RUN_RECORD]  # the other run's files are gone
    assert _record(out / "checkpoint-2")["run_id"] == _record(out)["run_id"]


def test_resume_true_takes_only_the_checkpoints_of_the_run_owning_the_directory(tmp_path, text_target, caplog):
    """Before: the newest checkpoint of any run was taken (a newer one left by another run resumed that run)."""
    other = _trainer(tmp_path / "other", text_target)
    other.train()
    ours = _trainer(tmp_path / "ours", text_target, max_steps=2)
    ours.train()
    out = tmp_path / "ours" / "out"
    shutil.copytree(tmp_path / "other" / "out" / "checkpoint-4", out / "checkpoint-4")  # another run's, newer
    with caplog.at_level(logging.WARNING, logger="dflash_hf"):
        chosen = resolve_resume_checkpoint(True, out, _record(out)["run_id"])
    assert chosen == str(out / "checkpoint-2")
    resumed = _trainer(tmp_path / "ours", text_target)
    resumed.train(resume_from_checkpoint=True)
    assert f"resuming from {out / 'checkpoint-2'}" in caplog.text
    with pytest.raises(RunDirectoryError, match=r"is of run .* but --output_dir .* belongs to run"):
        _trainer(tmp_path / "ours", text_target).train(str(tmp_path / "other" / "out" / "checkpoint-4"))


def test_resume_refuses_changed_settings_naming_each_and_records_an_allowed_change(tmp_path, text_target):
    """Before: a resume took another target, mask token or block size silently, and the export recorded them."""
    first = _trainer(tmp_path, text_target)
    first.train()
    checkpoint = str(tmp_path / "out" / "checkpoint-2")
    other_target = tiny_text_target(seed=1)  # the same shapes, other weights
    with pytest.raises(DFlashUserError) as info:
        _trainer(tmp_path, other_target, block_size=5).train(checkpoint)
    message = str(info.value)
    assert "the settings changed since it was saved" in message
    assert "target: checkpoint" in message and "block_size: checkpoint 4, this run 5" in message
    assert "--resume_allow_changes target block_size" in message and "mask_token_id" not in message
    with pytest.raises(DFlashUserError, match=r"num_draft_layers: checkpoint 1, this run 2.*weight shapes follow"):
        _trainer(tmp_path, text_target, num_draft_layers=2).train(checkpoint)
    allowed = _trainer(tmp_path, text_target, block_size=5, resume_allow_changes=["block_size"])
    allowed.train(checkpoint)
    export = Path(allowed.export_draft())
    changes = _record(export)["changes"]
    assert changes == [{"step": 2, "field": "block_size", "before": 4, "after": 5}]
    assert _record(export)["run_id"] == _record(tmp_path / "out")["run_id"]
    assert "/" not in json.dumps(_record(export)["settings"]["train_data"])  # no local paths beside an export


def test_a_dflash2_checkpoint_records_its_variant_and_refuses_a_dflash_resume(tmp_path, text_target):
    """Before: the record always said "dflash" (it read a key dflash_config never holds), so a DFlash2 checkpoint
    resumed as a DFlash draft was not named as a change of variant."""
    _trainer(tmp_path, text_target, variant="dflash2", max_steps=2).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert _record(checkpoint)["settings"]["variant"] == "dflash2"
    record = _record(checkpoint)
    record["settings"]["variant"] = "dflash"  # as older versions recorded every run
    (checkpoint / RUN_RECORD).write_text(json.dumps(record))
    _trainer(tmp_path, text_target, variant="dflash2", max_steps=4).train(str(checkpoint))  # the weights decide
    with pytest.raises(DFlashUserError, match=r"variant: checkpoint \"dflash2\", this run \"dflash\".*weight shapes"):
        _trainer(tmp_path, text_target, max_steps=4).train(str(checkpoint))


def test_a_checkpoint_of_a_target_of_another_width_is_a_clear_error(tmp_path, text_target):
    _trainer(tmp_path, text_target, max_steps=2).train()
    wide = tiny_text_target(hidden_size=96)
    with pytest.raises(DFlashUserError, match=r"hidden_size: checkpoint 64, this run 96.*weight shapes follow"):
        _trainer(tmp_path, wide).train(True)


def test_damaged_checkpoints_fall_back_or_are_refused_without_unpickling(tmp_path, text_target, caplog):
    _trainer(tmp_path, text_target).train()
    out = tmp_path / "out"
    newest = out / "checkpoint-4" / "optimizer.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated, the marker still there
    with caplog.at_level(logging.WARNING, logger="dflash_hf"):
        assert resolve_resume_checkpoint(True, out) == str(out / "checkpoint-2")
    assert "checkpoint-4 is damaged (optimizer.pt cannot be read" in caplog.text
    assert "falling back to the previous complete checkpoint" in caplog.text
    with pytest.raises(ValueError, match=r"checkpoint-4'? is damaged: optimizer.pt cannot be read"):
        resolve_resume_checkpoint(str(out / "checkpoint-4"), out)

    planted = tmp_path / "planted"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(planted),))

    torch.save({"state": Payload()}, out / "checkpoint-2" / "scheduler.pt")
    with pytest.raises(FileNotFoundError, match=r"damaged: checkpoint-4: .*checkpoint-2: scheduler.pt holds pickled"):
        resolve_resume_checkpoint(True, out)
    assert not planted.exists()  # never unpickled


def test_a_non_finite_step_stops_before_the_optimizer_takes_it(tmp_path):
    """Before: the loss turned NaN, the optimizer stepped on it and the run ended (and exported) normally."""
    model, tok = tiny_text_target()
    poison = {}

    class PoisonTargetAfter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                poison["weights"] = trainer_weights(trainer)
                with torch.no_grad():
                    next(model.parameters()).fill_(float("nan"))  # e.g. a non-finite audio sample's features

    trainer = _trainer(tmp_path, (model, tok))
    trainer.add_callback(PoisonTargetAfter())
    with pytest.raises(NonFiniteStepError, match=r"non-finite loss and gradient norm at optimizer step 3") as info:
        trainer.train()
    assert "the optimizer did not take the step" in str(info.value)
    assert f"The last complete checkpoint is {tmp_path / 'out' / 'checkpoint-2'}" in str(info.value)
    weights = trainer_weights(trainer)
    assert all(torch.equal(weights[k], v) for k, v in poison["weights"].items())  # step 3 never applied
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2"]


@pytest.mark.parametrize(
    "case", ["export_is_target", "export_in_target", "output_is_target", "export_holds_files", "output_is_a_model"]
)
def test_directories_a_run_must_not_write_over_are_refused(tmp_path, case):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    output, export = tmp_path / "out", tmp_path / "out" / "draft"
    if case == "export_is_target":
        export = target
    elif case == "export_in_target":
        export = target / "draft"
    elif case == "output_is_target":
        output = target
    elif case == "output_is_a_model":
        output = tmp_path / "other_model"
        output.mkdir()
        (output / "model.safetensors").write_bytes(b"")
    else:
        export = tmp_path / "data"
        export.mkdir()
        (export / "train.jsonl").write_text("")
    refusals = "target's directory or inside it|not a draft export|a model's directory"
    with pytest.raises(RunDirectoryError, match=refusals):
        check_run_directories(str(output), str(export), resuming=False, overwrite=True, target=str(target))


def test_training_data_is_compared_by_content_not_by_where_it_lies(tmp_path):
    from dflash_hf.training.run_identity import data_identity, setting_differences

    first = tmp_path / "a" / "train.jsonl"
    first.parent.mkdir()
    first.write_text('{"text": "one"}\n')
    recorded = {"train_data": data_identity([str(first)])}
    moved = tmp_path / "b" / "train.jsonl"
    moved.parent.mkdir()
    shutil.copy(first, moved)
    assert setting_differences(recorded, {"train_data": data_identity([str(moved)])}) == []
    first.write_text('{"text": "two"}\n')  # edited in place
    assert setting_differences(recorded, {"train_data": data_identity([str(first)])}) == ["train_data"]


def test_resume_auto_starts_the_run_then_resumes_it(tmp_path, text_target, caplog):
    """What a job script requeued after preemption passes every time: the first launch starts the run."""
    first = _trainer(tmp_path, text_target, max_steps=2)
    with caplog.at_level(logging.WARNING, logger="dflash_hf"):
        first.train(resume_from_checkpoint="auto")
    assert "resume: auto: no complete checkpoint" in caplog.text and first.state.global_step == 2
    run_id = _record(tmp_path / "out")["run_id"]
    again = _trainer(tmp_path, text_target, max_steps=4)
    with caplog.at_level(logging.WARNING, logger="dflash_hf"):
        again.train(resume_from_checkpoint="auto")
    assert f"resuming from {tmp_path / 'out' / 'checkpoint-2'}" in caplog.text
    assert _record(tmp_path / "out" / "checkpoint-4")["run_id"] == run_id
