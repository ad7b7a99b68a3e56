"""benchmarks/train_step.py at tiny size on CPU (its parts: train_step_parts/): it runs the product step and writes
every reported field."""

import importlib.util
import json

import pytest
from train_step_parts.shapes import parse_config
from utils import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "train_step.py"
FIELDS = {
    "shape",
    "mode",
    "config",
    "seq_len",
    "num_anchors",
    "blocks",
    "visible_pairs",
    "ms_per_step",
    "plan_ms",
    "tokens_per_s",
    "block_tokens_per_s",
    "model_tflop_per_step",
    "flops",
    "tflops",
    "mfu",
    "peak_gib",
}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("train_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_writes_all_fields(bench, tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--tiny", "--warmup", "0", "--steps", "1", "--configs", "attn=sdpa,ce=64,ckpt=1", "--out", str(out)]
    report = bench.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["device"] == "cpu" and report["matmul_tflops"] > 0
    rows = {r["mode"]: r for r in report["results"]}
    assert set(rows) == {"draft", "full"} and not any("error" in r for r in rows.values())
    for row in rows.values():
        assert FIELDS <= set(row) and row["ms_per_step"] > 0 and row["mfu"] > 0
        assert row["blocks"] == 16 and row["visible_pairs"] > 0
        mem = row["memory_gib"]  # what the peak holds, from tensor sizes (no peak on the CPU)
        assert mem["target_decoder_layers"] > 0 and mem["target_other"] > 0 and mem["draft_weights"] > 0
        assert mem["draft_grads"] == mem["draft_weights"] and mem["optimizer_states"] >= 2 * mem["draft_weights"]
        assert (mem["fixed_taps"] > 0) == (row["mode"] == "draft") and "activations_and_rest" not in mem
    # full = draft FLOPs + the target's forward and label projection
    draft, full = rows["draft"]["flops"], rows["full"]["flops"]
    assert {k: full[k] for k in draft} == draft and full["target_forward"] > 0 and full["target_argmax_labels"] > 0


def test_config_spec_parsing():
    assert parse_config("attn=sdpa,ckpt=1") == {
        "attn": "sdpa",
        "ce": "2048",
        "ckpt": "1",
        "compile": "none",
        "fp8": "0",
        "fp8lm": "0",
    }
    assert parse_config("fp8=1")["fp8"] == "1" and parse_config("fp8lm=1")["fp8lm"] == "1"
    with pytest.raises(ValueError, match="bad config item"):
        parse_config("attention=flex")
    with pytest.raises(ValueError, match="attn is flex"):
        parse_config("attn=dense")
    for bad in ("fp8=yes", "fp8lm=2"):
        with pytest.raises(ValueError, match="fp8 and fp8lm are 0|1"):
            parse_config(bad)


@pytest.mark.slow  # three tiny speech targets through the full step: ~8 s on 2 cores
def test_tiny_speech_rows_run_the_real_target_families(bench):
    """The CPU-sized versions of the whisper-base and packed Qwen3-ASR rows: the encoder runs in the full step,
    every packed micro-batch of the cycle is timed, and the speech rates are reported."""
    argv = [
        "--tiny",
        "--shape",
        "tiny-whisper",
        "tiny-qwen3-asr-packed",
        "--modes",
        "full",
        "--warmup",
        "0",
        "--steps",
        "1",
        "--configs",
        "attn=sdpa,ce=64",
    ]
    rows = {r["shape"]: r for r in bench.main(argv)["results"]}
    assert not any("error" in r for r in rows.values())
    whisper, asr = rows["tiny-whisper"], rows["tiny-qwen3-asr-packed"]
    assert whisper["batch_size"] == whisper["samples_per_step"] == 6 and len(whisper["micro_batches"]) == 1
    assert asr["batch_size"] == 1 and asr["samples_per_step"] > 1 and len(asr["micro_batches"]) == 4
    for row in rows.values():
        assert FIELDS <= set(row) and row["audio_s_per_step"] > 0 and row["audio_hours_per_gpu_hour"] > 0
        assert row["flops"]["target_forward"] > 0 and row["samples_per_s"] > 0
