"""Resume and reproducibility: exact resume at any step (lhotse padded / packed, workers, HF datasets, 2 DDP
ranks), --seed, the resume flag, complete-only checkpoints, a full disk, one final evaluation.

Run as `torchrun --nproc_per_node 2 tests/training/test_resume.py OUT_DIR` it is the DDP worker of
`test_ddp_speech_resume_past_the_first_epoch_is_exact`.
"""

from __future__ import annotations

import errno
import json
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (utils) when torchrun starts this file

from utils import (  # noqa: E402
    ListDataset,
    assert_bitwise_equal,
    end_ranks,
    make_args,
    make_trainer,
    random_rows,
    run_torchrun,
    text_batch,
    tiny_text_target,
    trainer_weights,
)

from dflash_hf import DFlashTrainer  # noqa: E402
from dflash_hf.testing import tiny
from dflash_hf.training.checkpoints import (  # noqa: E402
    COMPLETE_MARKER,
    last_complete_checkpoint,
    parse_resume_flag,
    resolve_resume_checkpoint,
)
from dflash_hf.training.training_args import DFlashDataArguments  # noqa: E402

# 12 utterances at max_tokens 600 make 6 batches per epoch on one rank, 3 per rank on two
STEPS, RESUME_AT = 10, 8  # checkpoint-8 lies in the second data epoch


def speech_assets(root: Path):
    tok = tiny.build_tokenizer()
    model, processor = tiny.build_qwen3_asr_target(tok, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)
    manifest = root / "speech" / "manifest.jsonl"
    if not manifest.exists():
        tiny.synthesize_speech(root / "speech", 12, seed=0)
    return model, processor, manifest


def speech_trainer(root: Path, name: str, assets, skip_bad_samples: bool = False, **kw) -> DFlashTrainer:
    model, processor, manifest = assets
    if skip_bad_samples:  # the same data plus one row whose audio does not exist
        lines = (
            manifest.read_text()
            + json.dumps({"audio_filepath": "audio/missing.wav", "duration": 1.0, "text": "yes"})
            + "\n"
        )
        manifest = manifest.with_name("with_bad_row.jsonl")
        manifest.write_text(lines)
    packing = kw.get("packing", False)
    base = dict(
        mask_token_id=262,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        packing_max_tokens=600 if packing else None,
    )
    args = make_args(root / name, **(base | kw))
    data_args = DFlashDataArguments(max_tokens=600, prompt="Transcribe.", skip_bad_samples=skip_bad_samples)
    return DFlashTrainer(
        args=args, target=model, processor=processor, data_args=data_args, train_dataset=[str(manifest)]
    )


def logged_epochs(trainer: DFlashTrainer) -> dict[int, float]:
    return {h["step"]: h["epoch"] for h in trainer.state.log_history if "loss" in h}


@pytest.fixture(scope="module")
def asr(tmp_path_factory):
    return speech_assets(tmp_path_factory.mktemp("asr"))


@pytest.mark.parametrize("case", ["padded", "workers", "packed", "skipped"])
@pytest.mark.slow  # 21 s on 2 busy cores
def test_speech_resume_past_the_first_epoch_is_exact(tmp_path, asr, case):
    """Before the fix the Trainer took max_steps as one epoch and skipped batches of the wrong epoch."""
    kw = {
        "padded": {},
        "workers": {"dataloader_num_workers": 1},
        "packed": {"packing": True},
        "skipped": {"skip_bad_samples": True},
    }[case]
    straight = speech_trainer(tmp_path, "a", asr, **kw)
    straight.train()
    checkpoint = tmp_path / "a" / "out" / f"checkpoint-{RESUME_AT}"
    state = json.loads((checkpoint / "dflash_data_state_rank0.json").read_text())
    assert state["epoch"] >= 1 and state["epoch_batches"], state  # past the first data epoch
    resumed = speech_trainer(tmp_path, "b", asr, **kw)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == STEPS
    assert_bitwise_equal(trainer_weights(straight), trainer_weights(resumed))
    epochs = logged_epochs(straight)
    assert list(epochs.values()) == sorted(epochs.values()) and epochs[STEPS] > 1  # monotonic data epochs
    assert logged_epochs(resumed) == epochs  # the resumed steps log the same epochs: never backwards (was 1.2, 1.1)
    skipped = resumed.speech_train_loader.bad_samples.skipped
    assert skipped == straight.speech_train_loader.bad_samples.skipped == state["skipped"]
    assert len(skipped) == (case == "skipped")


def test_loader_iteration_restarts_the_epoch_unless_a_position_was_restored(asr):
    from dflash_hf.data import build_train_dataloader

    model, processor, manifest = asr
    loader = build_train_dataloader(str(manifest), processor, model.config, max_tokens=600, seed=1)
    ids = lambda batches: [b["input_ids"].tolist() for b in batches]  # noqa: E731
    full = ids(loader)
    assert ids(loader) == full and loader.epoch_progress == 1.0  # a second pass of the same epoch: all of it
    loader.load_state_dict({"epoch": 0, "batches_consumed": 2})
    assert ids(loader) == full[2:]
    loader.load_state_dict({"epoch": 0, "batches_consumed": len(full) + 1})  # the data changed since the save
    with pytest.raises(ValueError, match=f"fewer than the {len(full) + 1} batches the checkpoint had handed out"):
        ids(loader)
    loader.set_epoch(1)
    stream, second, progress = loader.epochs(), [], []
    while (batch := next(stream)) is not None and loader.epoch == 1:  # epoch 1, up to the first batch of epoch 2
        second.append(batch["input_ids"].tolist())
        progress.append(loader.epoch_progress)
    assert second != full and loader.epoch_batches == [len(second)]  # reshuffled; its length recorded
    assert progress[-1] == 2.0 and max(progress[:-1]) < 2.0  # the epoch ends with its last batch


def test_epoch_save_strategy_saves_at_each_data_epoch_end(tmp_path, asr):
    trainer = speech_trainer(tmp_path, "a", asr, save_strategy="epoch", max_steps=8)
    trainer.train()
    first = json.loads((tmp_path / "a" / "out" / "checkpoint-6" / "trainer_state.json").read_text())
    assert first["epoch"] == 1.0  # the 6 batches of epoch 0, then the end of training
    assert sorted(p.name for p in (tmp_path / "a" / "out").glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]


@pytest.mark.parametrize("iterable", [False, True], ids=["map_style", "iterable"])
@pytest.mark.slow  # 11 s on 2 busy cores
def test_hf_dataset_resume_past_the_first_epoch_is_exact(tmp_path, iterable):
    """The iterable dataset has no length: before the fix it failed as the lhotse loader did."""
    from datasets import Dataset

    model, tok = tiny_text_target()
    rows = Dataset.from_list([{"p": p, "r": r} for p, r in random_rows(8, 250, seed=4)])
    if iterable:
        rows = rows.to_iterable_dataset(num_shards=1)

    def trainer(name: str) -> DFlashTrainer:
        args = make_args(
            tmp_path / name,
            mask_token_id=tok.convert_tokens_to_ids(tiny.MASK_TOKEN),
            max_steps=10,
            per_device_train_batch_size=2,
            save_strategy="steps",
            save_steps=3,
            learning_rate=1e-3,
            logging_steps=1,
        )
        collate = lambda items: text_batch([(x["p"], x["r"]) for x in items], tok.pad_token_id)  # noqa: E731
        return DFlashTrainer(args=args, target=model, train_dataset=rows, data_collator=collate)

    straight = trainer("a")
    straight.train()
    resumed = trainer("b")
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-6"))  # epoch 1 of 4 steps
    assert_bitwise_equal(trainer_weights(straight), trainer_weights(resumed))
    epochs = [h["epoch"] for h in resumed.state.log_history if "loss" in h]
    assert epochs == sorted(epochs)


def test_seed_sets_the_draft_initial_weights(tmp_path):
    """Before the fix the draft was built from whatever the global RNG held before Trainer.__init__ seeded it."""
    model, tok = tiny_text_target()
    rows = random_rows(2, 250)
    drafts = []
    for run, seed in enumerate((7, 7, 8)):
        torch.manual_seed(100 + run)  # a different global RNG state before each run
        args = make_args(tmp_path / str(run), mask_token_id=tok.convert_tokens_to_ids(tiny.MASK_TOKEN), seed=seed)
        drafts.append(trainer_weights(DFlashTrainer(args=args, target=model, train_dataset=ListDataset(rows))))
    assert_bitwise_equal(drafts[0], drafts[1])
    assert not torch.equal(drafts[0]["fc.weight"], drafts[2]["fc.weight"])


def test_resume_flag_accepts_true_false_strings_and_checks_paths_before_training(tmp_path):
    from dflash_hf.cli.config import parse_with_config
    from dflash_hf.cli.train import make_parser

    config = tmp_path / "run.yaml"
    config.write_text("resume_from_checkpoint: true\n")
    for argv in (["--resume_from_checkpoint", "True"], ["--config", str(config)]):  # CLI string, YAML boolean
        args, _ = parse_with_config(make_parser(), [*argv, "--output_dir", str(tmp_path / "out"), "--use_cpu", "true"])
        assert args.resume_from_checkpoint is True
    assert parse_resume_flag("true") is True and parse_resume_flag("False") is False
    assert parse_resume_flag("") is None and parse_resume_flag("runs/x/checkpoint-4") == "runs/x/checkpoint-4"
    assert make_args(tmp_path, resume_from_checkpoint="true").resume_from_checkpoint is True
    with pytest.raises(FileNotFoundError, match="--resume_from_checkpoint 'nowhere' is not a directory"):
        make_args(tmp_path, resume_from_checkpoint="nowhere").check_files()  # the CLI's pre-flight
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in output_dir"):
        resolve_resume_checkpoint("true", tmp_path / "out")


def _checkpoint(root: Path, step: int, complete: bool) -> Path:
    from safetensors.torch import save_file

    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, path / "model.safetensors")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if complete:
        (path / COMPLETE_MARKER).write_text("{}")
    return path


def test_resume_true_takes_the_last_complete_checkpoint_and_says_what_it_skipped(tmp_path, caplog):
    _checkpoint(tmp_path, 2, complete=True)
    good = _checkpoint(tmp_path, 4, complete=True)
    partial = [_checkpoint(tmp_path, 6, complete=False), _checkpoint(tmp_path, 10, complete=False)]
    assert last_complete_checkpoint(tmp_path) == (good, partial[::-1])
    with caplog.at_level(logging.WARNING, logger="dflash_hf"):
        assert resolve_resume_checkpoint(True, tmp_path) == str(good)
    assert "skipped incomplete checkpoints ['checkpoint-10', 'checkpoint-6']" in caplog.text
    assert f"resuming from {good}" in caplog.text
    with pytest.raises(ValueError, match="checkpoint-6' is incomplete"):
        resolve_resume_checkpoint(str(partial[0]), tmp_path)
    with pytest.raises(ValueError, match="is incomplete"):
        make_args(tmp_path, resume_from_checkpoint=str(partial[0])).check_files()


def _text_trainer(tmp_path, **kw) -> DFlashTrainer:
    model, tok = tiny_text_target()
    base = dict(
        mask_token_id=tok.convert_tokens_to_ids(tiny.MASK_TOKEN),
        per_device_train_batch_size=2,
        save_strategy="steps",
        save_steps=1,
    )
    return make_trainer(tmp_path, model, tok, random_rows(4, 250, seed=1), **(base | kw))


def test_interrupted_save_keeps_the_previous_checkpoint_despite_rotation(tmp_path, monkeypatch):
    """A save that dies before its marker leaves the older checkpoint in place (rotation waits for the marker)."""
    import dflash_hf.training.checkpoints as checkpoints

    real = checkpoints.mark_complete

    def dies_at_step_2(folder, step):
        if step == 2:
            raise KeyboardInterrupt("killed before the marker")
        real(folder, step)

    monkeypatch.setattr(checkpoints, "mark_complete", dies_at_step_2)
    trainer = _text_trainer(tmp_path, max_steps=2, save_total_limit=1)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    out = tmp_path / "out"
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()  # written, but not marked complete
    chosen, skipped = last_complete_checkpoint(out)
    assert chosen == out / "checkpoint-1" and skipped == [out / "checkpoint-2"]


def test_checkpoint_pushed_to_the_hub_is_complete(tmp_path, monkeypatch):
    """hub_strategy pushes run inside the Trainer's save, before it returns: the copy must already be complete."""
    from transformers import Trainer

    from dflash_hf.training.checkpoints import is_complete

    pushed = []
    monkeypatch.setattr(Trainer, "_push_from_checkpoint", lambda self, folder: pushed.append(is_complete(folder)))
    trainer = _text_trainer(tmp_path, max_steps=2)
    trainer.args.push_to_hub = True  # after __init__, which would create the Hub repository
    trainer.train()
    assert pushed == [True, True]


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1472 vs 1360"),
        OSError(errno.ENOSPC, "No space left on device"),
    ],
)
def test_full_disk_names_the_directory(tmp_path, monkeypatch, error):
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if "checkpoint-2" in str(f):
            raise error
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    trainer = _text_trainer(tmp_path, max_steps=2)
    with pytest.raises(OSError, match=r"no space left on device while writing .*checkpoint-2") as info:
        trainer.train()
    assert info.value.errno == errno.ENOSPC
    assert last_complete_checkpoint(tmp_path / "out")[0] == tmp_path / "out" / "checkpoint-1"


def test_final_evaluation_is_not_repeated_when_the_last_step_evaluated(tmp_path, monkeypatch):
    model, tok = tiny_text_target()
    rows = ListDataset(random_rows(4, 250, seed=1))
    args = make_args(
        tmp_path,
        mask_token_id=tok.convert_tokens_to_ids(tiny.MASK_TOKEN),
        max_steps=4,
        per_device_train_batch_size=2,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=2,
    )
    trainer = DFlashTrainer(
        args=args,
        target=model,
        train_dataset=rows,
        eval_dataset=rows,
        data_collator=lambda items: text_batch(items, tok.pad_token_id),
    )
    calls, evaluate = [], trainer.evaluate

    def counted(*args, **kwargs):
        calls.append(trainer.state.global_step)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(trainer, "evaluate", counted)
    trainer.train()
    assert calls == [2, 4]
    last_eval = [h for h in trainer.state.log_history if "eval_loss" in h][-1]
    assert last_eval["step"] == 4
    final = trainer.final_eval_metrics()  # what dflash-train reports after train()
    assert calls == [2, 4] and final["eval_loss"] == last_eval["eval_loss"]
    trainer.state.log_history = [h for h in trainer.state.log_history if "eval_loss" not in h]
    assert "eval_loss" in trainer.final_eval_metrics() and calls == [2, 4, 4]  # no evaluation yet: one is run


def test_dflash_train_evaluates_once_when_the_last_step_evaluates(tmp_path, monkeypatch):
    from dflash_hf.cli.train import run

    tiny.save_tiny_target(tmp_path / "target", hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)
    manifest = tiny.synthesize_speech(tmp_path / "speech", 4, seed=0)
    calls, evaluate = [], DFlashTrainer.evaluate

    def counted(self, eval_dataset=None, *args, **kwargs):
        if eval_dataset is None:  # a whole evaluation (the per-set calls inside it pass their dataset)
            calls.append(self.state.global_step)
        return evaluate(self, eval_dataset, *args, **kwargs)

    monkeypatch.setattr(DFlashTrainer, "evaluate", counted)
    metrics = run(
        [
            "--target_name_or_path",
            str(tmp_path / "target"),
            "--train_data",
            str(manifest),
            "--eval_data",
            f"dev={manifest}",
            "--mask_token_id",
            "262",
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "2",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "2",
            "--use_cpu",
            "true",
            "--block_size",
            "4",
            "--num_draft_layers",
            "1",
            "--max_tokens",
            "600",
            "--prompt",
            "Transcribe.",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
            "--label_source",
            "ground_truth",
            "--save_strategy",
            "no",
        ]
    )
    assert calls == [2] and "eval_dev_loss" in metrics  # before: [2, 2], the last step evaluated twice
    log = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]  # the whole log, saved
    assert [e["step"] for e in log if "eval_dev_tau" in e] == [2] and all("train_minutes" in e for e in log)


# ------------------------------------------------------------------------------------------ DDP (2 ranks)
DDP_TIMEOUT_S = 240


@pytest.mark.slow  # a torchrun launch of two ranks: 15-18 s on 2 cores
def test_ddp_speech_resume_past_the_first_epoch_is_exact(tmp_path):
    tiny.synthesize_speech(tmp_path / "speech", 12, seed=0)  # once, before the ranks read it
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        __file__,
        str(tmp_path),
    ]
    run_torchrun(cmd, DDP_TIMEOUT_S)
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["resumed_from_epoch"] >= 1  # the checkpoint lies past the first data epoch
        assert_bitwise_equal(result["straight"], result["resumed"])
        assert result["resumed_epochs"] == result["epochs"]


DDP_STEPS, DDP_RESUME_AT = 6, 4  # 3 batches per rank per epoch: checkpoint-4 is in the second epoch


def ddp_worker(out: Path) -> None:
    assets = speech_assets(out)
    straight = speech_trainer(out, "a", assets, max_steps=DDP_STEPS)
    rank = straight.args.process_index
    straight.train()
    checkpoint = out / "a" / "out" / f"checkpoint-{DDP_RESUME_AT}"
    epoch = json.loads((checkpoint / f"dflash_data_state_rank{rank}.json").read_text())["epoch"]
    resumed = speech_trainer(out, "b", assets, max_steps=DDP_STEPS)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    torch.save(
        {
            "straight": trainer_weights(straight),
            "resumed": trainer_weights(resumed),
            "resumed_from_epoch": epoch,
            "epochs": logged_epochs(straight),
            "resumed_epochs": logged_epochs(resumed),
        },
        out / f"rank{rank}.pt",
    )


if __name__ == "__main__":
    ddp_worker(Path(sys.argv[1]))
    end_ranks()
