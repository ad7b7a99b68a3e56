"""benchmarks/label_generation.py at tiny size on CPU: both modes run, write the same labels, and every
reported field is there (what it times is not checked: a test times nothing)."""

import importlib.util
import json

from utils import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "label_generation.py"


def test_tiny_run_reports_both_modes(tmp_path):
    spec = importlib.util.spec_from_file_location("label_generation", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "labels.json"
    assert (
        bench.main(
            ["--num_clips", "5", "--batch_size", "2", "--max_new_tokens", "3", "--repeats", "2", "--out", str(out)]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["clips"] == 5 and report["outputs_identical"] is True
    assert {m: len(s) for m, s in report["seconds"].items()} == {"off": 2, "on": 2}
    assert set(report["clips_per_s_best"]) == {"off", "on"} and report["speedup_best"] > 0
