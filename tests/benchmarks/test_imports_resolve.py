"""Every name that benchmarks/ (its scripts and their step packages) and scripts/ import from dflash_hf exists,
including imports inside functions (a benchmark's later steps import lazily, so a renamed helper would otherwise fail
only when that step runs)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*REPO_ROOT.glob("benchmarks/**/*.py"), *REPO_ROOT.glob("scripts/*.py")])  # steps' packages too


def package_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of each `import dflash_hf...` / `from dflash_hf... import name` in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dflash_hf":
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "dflash_hf"]
    return found


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_package_names_resolve(path):
    missing = []
    for line, module, name in package_imports(path):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"line {line}: {module} ({e})")
            continue
        if name is not None and name != "*" and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ImportError:
                missing.append(f"line {line}: {module}.{name}")
    assert not missing, f"{path.name} imports names dflash_hf does not have: {missing}"
