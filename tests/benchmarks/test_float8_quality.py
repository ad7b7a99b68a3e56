"""`benchmarks/float8_quality.py`: two dflash-train runs (with and without FP8 draft linears) on the same sentences,
their dev curves and the final dev tau_est difference reported."""

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
