"""`benchmarks/float8_quality.py`: two dflash-train runs (with and without FP8 draft linears) on the same sentences,
their dev curves and the final dev tau_est difference reported; `benchmarks/float8_lm_head_error.py`'s report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dflash_hf.testing import tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import float8_quality  # noqa: E402


@pytest.mark.slow  # two dflash-train processes: about 20 s on 2 cores
def test_both_runs_are_trained_evaluated_and_compared(tmp_path):
    target = tiny.save_tiny_target(tmp_path / "target", kind="text")
    sentences = tmp_path / "sentences.jsonl"
    rows = [{"text": f"the {w} sat on mat number {i}."} for i, w in enumerate(["cat", "dog", "owl", "fox"] * 6)]
    rows[0]["context"] = "Say where the cat sat."  # a generated-labels row keeps its own user turn
    sentences.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "result.json"
    argv = [
        "--target",
        str(target),
        "--sentences",
        str(sentences),
        "--train",
        "16",
        "--dev",
        "4",
        "--max_steps",
        "4",
        "--evals",
        "2",
        "--mask_token_id",
        str(tiny.build_tokenizer().convert_tokens_to_ids(tiny.MASK_TOKEN)),
        "--threads",
        "1",
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(out),
        "--",
        "--max_tokens",
        "512",
    ]
    assert float8_quality.main(argv) == 0
    train_rows = [json.loads(line) for line in (tmp_path / "work" / "train.jsonl").read_text().splitlines()]
    assert [r["context"] for r in train_rows[:2]] == ["Say where the cat sat.", float8_quality.PROMPT]
    res = json.loads(out.read_text())
    runs = res["runs"]
    assert [runs[n]["float8_draft_linears"] for n in ("reference", "float8")] == [False, True]
    for run in runs.values():
        assert [e["step"] for e in run["dev"]] == [2, 4] and all(e["eval_dev_tau_est"] >= 1.0 for e in run["dev"])
        assert "--float8_draft_linears" in run["command"]
    assert res["float8_minus_reference"] == pytest.approx(
        res["final_dev_tau_est"]["float8"] - res["final_dev_tau_est"]["reference"], abs=1e-4
    )
    with pytest.raises(SystemExit, match="need more"):
        float8_quality.main([*argv[:4], "--train", "100", *argv[6:]])


def test_lm_head_error_report_measures_both_precisions(tmp_path):
    """`benchmarks/float8_lm_head_error.py` on the tiny text target: logits and CE gradient errors of bf16 and FP8
    against float32 are reported, FP8's larger."""
    import float8_lm_head_error

    target = tiny.save_tiny_target(tmp_path / "target", kind="text")
    sentences = tmp_path / "sentences.jsonl"
    sentences.write_text(
        "".join(
            json.dumps({"text": f"the {w} sat on mat number {i}."}) + "\n"
            for i, w in enumerate(["cat", "dog", "owl", "fox"] * 10)
        )
    )
    out = tmp_path / "error.json"
    argv = [
        "--target",
        str(target),
        "--sentences",
        str(sentences),
        "--tokens",
        "200",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    assert float8_lm_head_error.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["tokens"] == 200
    logits, grads = res["logits"], res["ce_input_gradient"]
    assert 0 < logits["bf16"]["rms_logit_error"] < logits["fp8_forward"]["rms_logit_error"]
    assert 0 < grads["bf16"]["relative_error"] < grads["float8_lm_head"]["relative_error"] < 0.1
    with pytest.raises(SystemExit, match="needs more"):
        float8_lm_head_error.main([*argv[:4], "--tokens", "100000", *argv[6:]])
