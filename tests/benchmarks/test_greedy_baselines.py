"""`benchmarks/greedy_baselines.py`: speculative decoding beside plain and static-cache greedy `generate` (on the CPU
the static cache is not compiled: this checks the outputs and the report, not speed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dflash_hf.testing import tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import greedy_baselines  # noqa: E402


@pytest.mark.slow  # four decodes of three clips each: ~4 s on 2 cores
def test_static_cache_greedy_equals_plain_greedy_and_is_reported(tmp_path):
    from test_cli_eval import _save_draft  # (tests/benchmarks/conftest.py puts its folder on sys.path)
    from test_families import save_qwen2_audio

    save_qwen2_audio(tmp_path / "target")
    draft = _save_draft(tmp_path / "target", tmp_path / "draft")
    manifest = tiny.synthesize_speech(tmp_path / "data", 3, seed=2, min_dur=0.5, max_dur=1.5)
    argv = [
        "--draft",
        str(draft),
        "--target",
        str(tmp_path / "target"),
        "--data",
        str(manifest),
        "--prompt",
        "Transcribe.",
        "--max_new_tokens",
        "6",
        "--device",
        "cpu",
    ]
    assert greedy_baselines.main([*argv, "--output_json", str(tmp_path / "a.json")]) == 0
    res = json.loads((tmp_path / "a.json").read_text())
    spec, static = res["speculative"], res["static_greedy"]
    assert spec["prompts"] == 3 and spec["outputs_identical"]
    assert static["identical_to_greedy"] and static["tokens"] == spec["greedy_tokens"] == 18
    assert static["warmup_prompt"] in (0, 1, 2) and res["speedup_vs_static_greedy"] > 0 and res["device"] == "cpu"
    # a target that decodes without generate (the model-side single-placeholder row): recorded, not raised
    argv_model_side = [*argv, "--family", "qwen2_audio_single_placeholder", "--output_json", str(tmp_path / "b.json")]
    assert greedy_baselines.main(argv_model_side) == 0
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["speculative"]["outputs_identical"] and res["speedup_vs_static_greedy"] is None
    assert "decodes without generate" in res["static_greedy"]["error"]
