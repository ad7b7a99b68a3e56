"""benchmarks/tau_curve.py: tau over training minutes from a run's log, and the decoded checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from utils import REPO_ROOT, script_fixture

from dflash_hf import DFlashConfig, DFlashDraftModel
from dflash_hf.testing import tiny

curve = script_fixture(REPO_ROOT / "benchmarks" / "tau_curve.py")


def _run(root, history):
    root.mkdir(parents=True)
    (root / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    return root


HISTORY = [
    {"loss": 3.0, "tau_est": 1.5, "train_minutes": 0.5, "step": 10},
    {
        "eval_dev_tau": 1.4,
        "eval_dev_tau_est": 2.0,
        "eval_dev_greedy_walk_tau_est": 1.45,
        "train_minutes": 0.8,
        "step": 10,
    },
    {
        "eval_dev_tau": 1.9,
        "eval_dev_tau_est": 2.6,
        "eval_dev_selector_greedy_walk_tau_est": 1.95,
        "train_minutes": 1.7,
        "step": 20,
    },
    {"eval_test_tau": 1.2, "train_minutes": 1.8, "step": 20},
]


def test_curves_take_the_sets_real_tau_and_estimates_over_minutes(curve, tmp_path):
    got = curve.curves(HISTORY, "dev")
    assert got["tau"] == [(0.8, 1.4), (1.7, 1.9)] and got["tau_est"] == [(0.8, 2.0), (1.7, 2.6)]
    assert got["selector_greedy_walk_tau_est"] == [(1.7, 1.95)]  # the selector's walk where a DFlash2 log has it
    assert curve.minutes_at(HISTORY, 20) == 1.8 and curve.minutes_at(HISTORY, 30) is None
    a = _run(tmp_path / "a", HISTORY)
    b = _run(tmp_path / "b", [{**e, "train_minutes": 2 * e["train_minutes"]} for e in HISTORY])
    out = tmp_path / "fig" / "tau.png"
    assert curve.main([str(a), str(b), "--labels", "A", "B", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    points = json.loads(out.with_suffix(".json").read_text())
    assert points["B"]["curves"]["tau"] == [[1.6, 1.4], [3.4, 1.9]]
    with pytest.raises(SystemExit, match="no eval_dev_tau with train_minutes"):
        curve.main([str(_run(tmp_path / "old", [{"eval_dev_tau_est": 2.0, "step": 5}])), "--out", str(out)])


def test_decode_gives_each_kept_checkpoint_its_real_tau_at_its_minutes(curve, tmp_path):
    tok = tiny.build_tokenizer()
    target_dir = tiny.save_tiny_target(tmp_path / "target", "text", tokenizer=tok, hidden_size=32, num_layers=2)
    cfg = DFlashConfig.from_target_config(
        tiny.build_text_target(tok, hidden_size=32, num_layers=2).config,
        mask_token_id=tok.convert_tokens_to_ids(tiny.MASK_TOKEN),
        num_hidden_layers=1,
        block_size=4,
    )
    run = _run(tmp_path / "run", [{"loss": 1.0, "train_minutes": m, "step": s} for s, m in ((1, 0.25), (2, 0.5))])
    for step in (1, 2):
        torch.manual_seed(step)
        DFlashDraftModel(cfg).save_pretrained(run / f"checkpoint-{step}")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("yes no up", "left right", "go stop")))
    out = tmp_path / "tau.png"
    argv = [str(run), "--decode", "--target", str(target_dir), "--data", str(prompts), "--out", str(out)]
    assert curve.main([*argv, "--num_samples", "2", "--max_new_tokens", "6", "--device", "cpu"]) == 0
    decoded = json.loads(out.with_suffix(".json").read_text())["run"]["decoded"]
    assert [(m, s) for m, _, s in decoded] == [(0.25, 1), (0.5, 2)] and all(1.0 <= t <= 4 for _, t, _ in decoded)
