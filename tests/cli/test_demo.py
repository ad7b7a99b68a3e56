"""The embedded default job (`dflash-demo`, examples/configs/demo.yaml) at reduced size, its summary's next step,
and README's "use the exported draft" snippet run as written on the demo's outputs."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

from utils import REPO_ROOT

from dflash_hf.cli import demo
from dflash_hf.cli import train as cli_train
from dflash_hf.cli.config import parse_with_config
from dflash_hf.export import load_draft_strict


def readme_snippet(heading: str) -> str:
    """The first python block of README's section `heading`."""
    section = (REPO_ROOT / "README.md").read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_demo_config_runs_end_to_end_at_reduced_steps(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # README's snippet reads the demo's default paths, runs/demo/...
    out = tmp_path / "runs" / "demo"
    argv = [
        "--output_dir",
        str(out),
        "--num_train_utterances",
        "12",
        "--num_dev_utterances",
        "3",
        "--target_teach_steps",
        "3",
        "--max_steps",
        "3",
        "--save_strategy",
        "no",
        "--decode_prompts",
        "2",
        "--decode_max_new_tokens",
        "8",
        "--disable_tqdm",
        "true",
    ]
    summary = demo.run(argv)
    assert summary["decode_outputs_identical"] is True  # speculative output == target greedy output
    assert summary["decode_prompts"] == 2 and summary["decode_cycles"] >= 1
    assert 1.0 <= summary["decode_tau"] <= summary["block_size"] == 8
    assert summary["eval_dev_tau_est"] >= 1.0 and 1.0 <= summary["eval_dev_tau"] <= 8  # the headline: real decoding
    assert summary["target_wer_utterances"] == 3 and summary["target_wer"] >= 0.0
    assert json.loads((out / "demo_summary.json").read_text()) == summary
    draft = load_draft_strict(out / "draft")
    assert draft.config.block_size == 8 and draft.config.num_hidden_layers == 2
    target = json.loads((out / "assets" / "target" / "config.json").read_text())["text_config"]
    assert target["head_dim"] == 64 and target["num_attention_heads"] * 64 == target["hidden_size"]  # as vLLM serves
    printed = capsys.readouterr().out
    assert "=== dflash_hf demo ===" in printed and f"WER {summary['target_wer']:.1%} on 3 held-out" in printed
    assert f"validation          tau {summary['eval_dev_tau']:.2f} (real decoding of dev prompts" in printed
    for path in ("target_dir", "train_manifest", "dev_manifest"):  # the reusable assets are named
        assert summary[path] in printed and Path(summary[path]).exists()
    assert "slower than greedy" in printed and "docs/QUALITY.md" in printed

    # the printed next step is the demo's recipe: parsed by dflash-train, the demo's run's settings
    command = shlex.split(summary["train_command"])
    assert command[0] == "dflash-train" and summary["train_command"] in printed.replace(" \\\n      ", " ")
    args, data_args = parse_with_config(cli_train.make_parser(), command[1:])
    _, run_args, run_data = parse_with_config(demo.make_parser(), demo.with_default_config(argv))
    assets = (Path(summary[k]) for k in ("target_dir", "train_manifest", "dev_manifest"))
    demo.use_assets(run_args, run_data, *assets, summary["mask_token_id"])
    assert data_args == run_data and data_args.max_tokens == 3000 and data_args.prompt == "Transcribe the audio."
    differ = {f.name for f in dataclasses.fields(args) if getattr(args, f.name) != getattr(run_args, f.name)}
    assert differ - {"logging_dir"} == {"output_dir", "overwrite_output_dir"}  # its own run directory (and logs)
    assert args.output_dir == demo.NEXT_OUTPUT_DIR and not args.overwrite_output_dir
    assert (args.learning_rate, args.num_anchors, args.max_steps) == (0.004, 32, 3)  # the config's and the overrides

    # README's "use the exported draft" snippet, exactly as written
    exec(compile(readme_snippet("Use the exported draft"), "README.md", "exec"), {})
    decoded = capsys.readouterr().out
    assert decoded.startswith("[") and "]" in decoded  # the transcript and the acceptance lengths
