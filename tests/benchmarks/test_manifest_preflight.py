"""benchmarks/manifest_preflight.py: one `dflash-train` process per manifest size reaches its first step and the
results name what was measured (the timings themselves are a benchmark's business, not a test's)."""

import json

import pytest
from utils import REPO_ROOT, script_fixture

bench = script_fixture(REPO_ROOT / "benchmarks" / "manifest_preflight.py")


@pytest.mark.slow  # a dflash-train process to its first step: 8-15 s on 2 cores
def test_the_benchmark_reaches_the_first_step_and_records_its_command(tmp_path, bench):
    out = tmp_path / "preflight.json"
    argv = ["--rows", "40", "--work_dir", str(tmp_path / "work"), "--out", str(out)]
    result = bench.main(argv)
    assert json.loads(out.read_text()) == result
    assert result["command"] == ["python", "benchmarks/manifest_preflight.py", *argv]
    assert set(result["machine"]) >= {"cpu", "usable_cores", "python"} and result["date"]
    (row,) = result["results"]
    assert row["rows"] == 40 and len(row["runs"]) == 1
    assert row["time_to_first_step_s"] > 0 and row["peak_rss_gb"] > 0 and row["cpu_s"] > 0
    lines = (tmp_path / "work" / "manifest_40.jsonl").read_text().splitlines()
    assert len(lines) == 40 and json.loads(lines[39])["text"].endswith(" 39")
