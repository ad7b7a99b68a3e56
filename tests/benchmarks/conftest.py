"""The benchmark tests build real-layout targets and drafts with helpers of the package folders' tests
(`test_families.save_qwen2_audio`, `test_cli_eval._save_draft`): their folders go on `sys.path` (after everything
else), so these tests import them whichever folders a run collects; so does `benchmarks/`, whose step packages the
tests import."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
for folder in ("targets", "cli"):
    if str(TESTS_DIR / folder) not in sys.path:
        sys.path.append(str(TESTS_DIR / folder))

# the scripts' step packages (quality_steps, ...), importable as the scripts import them
BENCHMARKS_DIR = TESTS_DIR.parent / "benchmarks"
if str(BENCHMARKS_DIR) not in sys.path:
    sys.path.append(str(BENCHMARKS_DIR))
