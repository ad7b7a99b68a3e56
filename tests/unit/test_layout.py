"""The test suite's own layout: every test file in a tier, unit tests without processes or Trainer runs."""

from __future__ import annotations

import ast

from utils import TESTS_DIR

TIERS = ("unit", "integration", "gpu")
# Calls that make a test an integration test: a Trainer run, a CLI entry point, another process.
INTEGRATION_CALLS = {"train", "evaluate", "main", "Popen", "run_command"}


def _called_names(path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names


def _imported_modules(path) -> set[str]:
    tree = ast.parse(path.read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return mods | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_every_test_file_is_in_a_tier():
    assert not sorted(p.name for p in TESTS_DIR.glob("test_*.py")), "move tests/test_*.py into tests/<tier>/"
    dirs = {p.parent.name for p in TESTS_DIR.rglob("test_*.py")}
    assert dirs <= set(TIERS), dirs


def test_unit_tests_start_no_process_and_run_no_trainer():
    for path in sorted((TESTS_DIR / "unit").glob("test_*.py")):
        assert not {"subprocess", "torch.distributed.run"} & _imported_modules(path), path.name
        # `run_command` on an argument error and `train()` failing its checks are allowed in test_config_validation:
        # both stop before any loading; every other unit file calls none of them.
        calls = _called_names(path) & INTEGRATION_CALLS
        if path.name == "test_config_validation.py":
            calls -= {"run_command", "train"}
        assert not calls, (path.name, sorted(calls))
        assert not any(m.startswith("test_") for m in _imported_modules(path)), f"{path.name}: import from utils"
