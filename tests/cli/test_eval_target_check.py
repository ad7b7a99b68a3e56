"""`dflash-eval` refuses a draft trained for another target (another vocabulary, or weights other than those its
export's run record names) unless `--allow_target_mismatch true`, which records the differences in the results."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash_hf.cli import console
from dflash_hf.cli import eval as cli_eval
from dflash_hf.testing import tiny

SHAPE = dict(hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A draft exported by `dflash-train` (2 steps) for a tiny Qwen3-ASR target, another target of the same shapes
    and other weights, and a manifest."""
    root = tmp_path_factory.mktemp("eval_target")
    tok = tiny.build_tokenizer()
    tiny.save_tiny_target(root / "target", tokenizer=tok, **SHAPE)
    tiny.save_tiny_target(root / "other", tokenizer=tok, seed=1, **SHAPE)
    manifest = tiny.synthesize_speech(root / "speech", 4, seed=0, max_dur=0.8)
    argv = [
        "--target_name_or_path", str(root / "target"), "--train_data", str(manifest), "--mask_token_id", "262",
        "--output_dir", str(root / "out"), "--max_steps", "2", "--use_cpu", "true", "--block_size", "4",
        "--num_draft_layers", "1", "--num_anchors", "8", "--max_tokens", "600", "--prompt", "Transcribe.",
        "--label_source", "ground_truth", "--attention_backend", "sdpa", "--report_to", "none", "--disable_tqdm",
        "true", "--save_strategy", "no",
    ]  # fmt: skip
    assert console.run_command("dflash-train", argv) == 0
    return root, manifest


def _argv(root, manifest, target: str, out: str, *extra: str) -> list[str]:
    return [
        "--draft", str(root / "out" / "draft"), "--target", str(root / target), "--data", str(manifest),
        "--max_new_tokens", "4", "--num_samples", "1", "--output_json", str(root / out), *extra,
    ]  # fmt: skip


def test_the_target_a_draft_was_trained_for_passes_the_check(trained):
    root, manifest = trained
    assert cli_eval.main(_argv(root, manifest, "target", "same.json")) == 0
    check = json.loads((root / "same.json").read_text())["target_check"]
    assert check["differences"] == [] and not check["allowed"]
    assert check["recorded_fingerprint"] == check["target_fingerprint"]  # the training run's own target


def test_another_target_of_the_same_shapes_is_refused_unless_allowed(trained, capsys):
    root, manifest = trained
    assert console.run_command("dflash-eval", _argv(root, manifest, "other", "other.json")) == 2
    err = capsys.readouterr().err
    assert f"dflash-eval: error: --draft {root / 'out' / 'draft'} was not trained for --target {root / 'other'}" in err
    assert "names a target with weights fingerprint" in err and "--allow_target_mismatch true" in err
    assert not (root / "other.json").exists()  # refused before decoding

    assert cli_eval.main(_argv(root, manifest, "other", "other.json", "--allow_target_mismatch", "true")) == 0
    check = json.loads((root / "other.json").read_text())["target_check"]
    assert check["allowed"] and len(check["differences"]) == 1
    assert check["recorded_fingerprint"] != check["target_fingerprint"]


def test_a_draft_of_another_vocabulary_is_refused(trained, tmp_path):
    root, manifest = trained
    draft = tmp_path / "draft"
    shutil.copytree(root / "out" / "draft", draft)
    config = json.loads((draft / "config.json").read_text())
    config["vocab_size"] += 8
    (draft / "config.json").write_text(json.dumps(config))
    argv = _argv(root, manifest, "target", "vocab.json")
    argv[argv.index("--draft") + 1] = str(draft)
    with pytest.raises(ValueError, match=r"was not trained for --target .*: the draft was trained against vocab_size"):
        cli_eval.main(argv)
