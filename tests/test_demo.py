"""The embedded default job (`dflash-demo`, examples/configs/demo.yaml) at reduced size."""

from __future__ import annotations

import json

from dflash_hf import demo
from dflash_hf.hub import load_draft_strict


def test_demo_config_runs_end_to_end_at_reduced_steps(tmp_path, capsys):
    out = tmp_path / "demo"
    summary = demo.run(
        [
            "--output_dir", str(out),
            "--num_train_utterances", "12",
            "--num_dev_utterances", "3",
            "--target_num_layers", "4",
            "--target_teach_steps", "3",
            "--max_steps", "3",
            "--save_strategy", "no",
            "--decode_prompts", "2",
            "--decode_max_new_tokens", "8",
            "--disable_tqdm", "true",
        ]
    )
    assert summary["decode_outputs_identical"] is True  # speculative output == target greedy output
    assert summary["decode_prompts"] == 2 and summary["decode_cycles"] >= 1
    assert 1.0 <= summary["decode_tau"] <= summary["block_size"] == 8
    assert summary["eval_dev_tau_est"] >= 1.0
    assert json.loads((out / "demo_summary.json").read_text()) == summary
    draft = load_draft_strict(out / "draft")
    assert draft.config.block_size == 8 and draft.config.num_hidden_layers == 2
    assert "=== dflash_hf demo ===" in capsys.readouterr().out
