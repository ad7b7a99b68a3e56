"""A new user's first hour: launches that do what they say, the mask-id hint, validate-only equal to
the training run's evaluation, quiet checkpoint saves, CPU threads, README's snippet and install pins."""

from __future__ import annotations

import re

import pytest
from utils import REPO_ROOT

from dflash_hf import DFlashTrainingArguments
from dflash_hf.cli import train as cli_train
from dflash_hf.data.text_prompts import count_records
from dflash_hf.targets.mask_token import mask_token_candidates
from dflash_hf.testing import tiny
from dflash_hf.training.training_args import DFlashDataArguments

DEMO_MASK_ID = 262  # <|dflash_mask|> of the tiny tokenizer


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    """A saved tiny Qwen3-ASR target (the demo's kind) and small train / dev manifests."""
    root = tmp_path_factory.mktemp("speech")
    target = tiny.save_tiny_target(root / "target", kind="qwen3_asr", num_layers=4, seed=0)
    train = tiny.synthesize_speech(root / "train", 8, seed=0, max_dur=1.2)
    dev = tiny.synthesize_speech(root / "dev", 4, seed=1, max_dur=1.2)
    return target, train, dev


# ------------------------------------------------------------------------------------------------
# Launches
# ------------------------------------------------------------------------------------------------
def test_accelerate_cpu_with_several_processes_is_refused_with_the_fix(tmp_path, monkeypatch):
    # what `accelerate launch --cpu --num_processes 2` exports to its ONE process
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(ValueError, match=r"starts a single process.*--multi_gpu --num_processes N"):
        DFlashTrainingArguments(output_dir=str(tmp_path))
    monkeypatch.delenv("MASTER_ADDR")  # `accelerate launch --cpu` (one process): fine
    assert DFlashTrainingArguments(output_dir=str(tmp_path)).world_size == 1


# ------------------------------------------------------------------------------------------------
# Mask token candidates
# ------------------------------------------------------------------------------------------------
def test_missing_mask_token_lists_the_demo_targets_reserved_token(speech, tmp_path):
    target, train, _ = speech
    args = DFlashTrainingArguments(output_dir=str(tmp_path), target_name_or_path=str(target), use_cpu=True)
    data = DFlashDataArguments(train_data=[str(train)])
    with pytest.raises(ValueError) as err:
        cli_train.train(args, data)
    message = str(err.value)
    assert "--mask_token_id is required" in message
    assert re.search(r"Candidates, best first:\n  262 <\|dflash_mask\|> \(", message)
    assert message.rstrip().endswith("e.g. --mask_token_id 262")
    for used in ("<|im_end|>", "<|endoftext|>", "<|audio_pad|>", "<|im_start|>"):  # eos, pad, audio, template
        assert used not in message


def test_mask_token_candidates_of_a_text_target_best_first():
    tok = tiny.build_tokenizer()
    model = tiny.build_text_target(tok, num_layers=1, hidden_size=32)
    model.resize_token_embeddings(len(tok) + 10)  # embedding rows past the tokenizer, as in Qwen3 checkpoints
    got = mask_token_candidates(tok, model.get_input_embeddings().weight.shape[0], target_config=model.config)
    assert [c.token_id for c in got] == [DEMO_MASK_ID, len(tok), len(tok) + 1, len(tok) + 2]
    assert "past the tokenizer" in got[1].reason and got[1].token is None
    # a tokenizer without a mask-named token: reserved / unused special tokens come after the free rows
    tok.add_special_tokens({"additional_special_tokens": ["<|reserved_0|>", "<|spare|>"]})
    vocab = len(tok) + 1
    got = mask_token_candidates(tok, vocab)
    ids = [c.token_id for c in got]
    reserved, spare = tok.convert_tokens_to_ids(["<|reserved_0|>", "<|spare|>"])
    assert ids == [DEMO_MASK_ID, len(tok), reserved, spare]
    assert tok.eos_token_id not in ids and tok.pad_token_id not in ids


# ------------------------------------------------------------------------------------------------
# Validate-only repeats the training run's evaluation
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow  # 9 s on 2 busy cores
def test_validate_only_takes_block_size_and_anchors_from_the_export(speech, tmp_path, capsys):
    target, train, dev = speech
    common = [
        "--target_name_or_path",
        str(target),
        "--eval_data",
        f"dev={dev}",
        "--use_cpu",
        "true",
        "--disable_tqdm",
        "true",
        "--report_to",
        "none",
        "--attention_backend",
        "sdpa",
    ]
    trained = cli_train.run(
        [
            *common,
            "--output_dir",
            str(tmp_path / "run"),
            "--train_data",
            str(train),
            "--mask_token_id",
            "262",
            "--block_size",
            "4",
            "--num_anchors",
            "8",
            "--num_draft_layers",
            "1",
            "--max_steps",
            "2",
            "--save_strategy",
            "no",
            "--seed",
            "0",
            "--learning_rate",
            "0.003",
        ]
    )
    export = tmp_path / "run" / "draft"
    # block size, anchors and seed all left at their defaults: the export's block size and anchors are used
    validated = cli_train.run(
        [
            *common,
            "--output_dir",
            str(tmp_path / "val"),
            "--validate_only",
            "true",
            "--init_from_pretrained",
            str(export),
        ]
    )
    keys = sorted(k for k in trained if k.startswith("eval_dev_") and not k.endswith("_runtime"))
    assert "eval_dev_acc_slot3" in keys and "eval_dev_acc_slot4" not in keys  # block 4
    assert {k: validated[k] for k in keys} == {k: trained[k] for k in keys}
    # a block size given explicitly wins over the export's
    at8 = cli_train.run(
        [
            *common,
            "--output_dir",
            str(tmp_path / "val8"),
            "--validate_only",
            "true",
            "--init_from_pretrained",
            str(export),
            "--block_size",
            "8",
        ]
    )
    assert "eval_dev_acc_slot7" in at8
    capsys.readouterr()


def test_checkpoint_saves_and_the_export_draw_no_bars_of_their_own(tmp_path, capfd):
    from utils import make_trainer, random_rows, tiny_text_target

    model, tok = tiny_text_target()
    trainer = make_trainer(
        tmp_path, model, tok, random_rows(4, 250), max_steps=1, save_strategy="steps", save_steps=1, disable_tqdm=False
    )
    trainer.train()
    trainer.export_draft()
    err = capfd.readouterr().err
    assert (tmp_path / "out" / "checkpoint-1" / "model.safetensors").is_file()
    assert "1/1" in err  # the training bar is drawn
    assert "Writing model shards" not in err
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # restored after each save


def test_dflash_eval_bar_has_a_total_and_writes_beside_the_draft_never_over_results(tmp_path, capfd):
    import gzip
    import json

    from dflash_hf import DFlashConfig, DFlashDraftModel
    from dflash_hf.cli import eval as cli_eval

    target = tiny.save_tiny_target(
        tmp_path / "target", kind="text", hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1
    )
    cfg = DFlashConfig.from_target_config(
        tiny.build_text_target(hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1).config,
        mask_token_id=DEMO_MASK_ID,
        num_hidden_layers=1,
        block_size=4,
    )
    DFlashDraftModel(cfg).save_pretrained(tmp_path / "draft")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a b", "c d", "e f")) + "\n")
    argv = [
        "--draft",
        str(tmp_path / "draft"),
        "--target",
        str(target),
        "--data",
        str(prompts),
        "--max_new_tokens",
        "4",
    ]
    assert cli_eval.main(argv) == 0
    out, err = capfd.readouterr()
    assert "3/3" in err
    written = tmp_path / "draft" / "eval_prompts.json"  # beside the draft, named after the data
    assert f"results written to {written}" in out and json.loads(written.read_text())["prompts"] == 3
    with pytest.raises(FileExistsError, match=r"eval_prompts.json exists .*--overwrite_output_json true"):
        cli_eval.main([*argv, "--num_samples", "2"])  # refused before anything loads: no bar
    assert "dflash-eval" not in capfd.readouterr().err
    assert cli_eval.main([*argv, "--num_samples", "2", "--overwrite_output_json", "true"]) == 0
    assert "2/2" in capfd.readouterr().err and json.loads(written.read_text())["prompts"] == 2
    assert cli_eval.main([*argv, "--num_samples", "1", "--output_json", str(tmp_path / "one.json")]) == 0
    assert json.loads((tmp_path / "one.json").read_text())["output_json"] == str(tmp_path / "one.json")
    packed = tmp_path / "prompts.jsonl.gz"
    packed.write_bytes(gzip.compress(prompts.read_bytes()))
    assert count_records(str(packed)) == 3


def test_readme_installs_what_ci_tests():
    readme = (REPO_ROOT / "README.md").read_text()
    setup = readme.split("## Set up on a new machine\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = setup.strip().splitlines()
    assert len(commands) == 2  # install + demo, then the test suite
    install = re.search(r"pip install (-e \S+ -c requirements-ci\.txt)", commands[0])
    assert install, commands[0]
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert f"pip install -q {install.group(1)}" in ci  # CI installs with README's command
    assert "pip install torch==2.13.0" in commands[0] and "torch==2.13.0" in ci
    pins = [line for line in (REPO_ROOT / "requirements-ci.txt").read_text().splitlines() if "==" in line]
    assert any(p.startswith("transformers==") for p in pins)


def test_per_slot_accuracy_plot_draws_one_curve_per_logged_step(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_training", REPO_ROOT / "scripts" / "plot_training.py")
    plot_training = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_training)
    steps = range(10, 210, 10)  # 20 training logs, 2 evaluations, block 16 (15 slots)
    series = {f"acc_slot{k}": [(s, 1.0 / k + s / 1000) for s in steps] for k in range(1, 16)}
    series.update({f"eval_dev_acc_slot{k}": [(100, 0.5 / k), (200, 0.6 / k)] for k in range(1, 16)})
    series["loss"] = [(s, 1.0) for s in steps]
    curves = plot_training.slot_curves(series)
    assert list(curves) == ["", "eval_dev_"]
    train = curves[""]
    assert len(train) == plot_training.MAX_SLOT_CURVES and train[0][0] == 10 and train[-1][0] == 200
    assert len(train[-1][1]) == 15 and train[-1][1][0] == pytest.approx(1.2)  # slot 1 of step 200
    assert [s for s, _ in curves["eval_dev_"]] == [100, 200]
    written = {p.name for p in plot_training.plot(series, tmp_path)}
    assert written == {"loss.png", "acc_slot.png"}  # the per-slot series no longer crowd an over-steps figure
