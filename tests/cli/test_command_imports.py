"""`dflash-eval` and `dflash-generate-labels` import nothing of `dflash_hf.training`: decoding evaluation, evaluation
rows and the label pipeline live in `generation/`, `data/` and `export/`, the commands only parse, call and report."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys

import pytest
from utils import REPO_ROOT

from dflash_hf.lazy import EXPORTED

PACKAGE = REPO_ROOT / "dflash_hf"
COMMANDS = ("dflash_hf.cli.eval", "dflash_hf.cli.generate_labels")


def _module_file(name: str):
    """The file of package module `name` (a module or a package's `__init__`), None when it is not one."""
    path = REPO_ROOT.joinpath(*name.split("."))
    for file in (path.with_suffix(".py"), path / "__init__.py"):
        if file.is_file():
            return file
    return None


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of the import nodes under `if TYPE_CHECKING:` (never run)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    return skipped


def _lazy_exports(package: str) -> dict[str, str]:
    """{name: module} of what `package` exports on first use (importing a package of the repository is light)."""
    if package.split(".")[0] == "dflash_hf" and (REPO_ROOT.joinpath(*package.split(".")) / "__init__.py").is_file():
        importlib.import_module(package)
    return EXPORTED.get(package, {})


def _imports(name: str) -> set[str]:
    """The package modules module `name` imports, lazily or not (a submodule's packages included; a name a package
    exports on first use as the module it comes from)."""
    tree = ast.parse(_module_file(name).read_text())
    skipped, found = _type_checking_only(tree), set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            for alias in node.names:
                if _lazy_exports(node.module).get(alias.name):
                    found.add(_lazy_exports(node.module)[alias.name])
                elif _module_file(f"{node.module}.{alias.name}"):
                    found.add(f"{node.module}.{alias.name}")
    modules = {m for m in found if m.split(".")[0] == "dflash_hf" and _module_file(m)}
    return modules | {".".join(m.split(".")[:i]) for m in modules for i in range(1, m.count(".") + 1)}


def _reached(start: str) -> dict[str, str]:
    """Every package module `start` may import, directly or through others: module -> the module importing it."""
    seen, todo = {start: ""}, [start]
    while todo:
        name = todo.pop()
        for dep in sorted(_imports(name) - set(seen)):
            seen[dep] = name
            todo.append(dep)
    return seen


def test_no_module_the_two_commands_may_import_is_of_training():
    for command in COMMANDS:
        reached = _reached(command)
        assert "dflash_hf.data.eval_rows" in reached or "dflash_hf.data.label_manifest" in reached  # the walk works
        training = sorted(m for m in reached if m.startswith("dflash_hf.training"))
        chains = [f"{m} (imported by {reached[m]})" for m in training]
        assert not training, f"{command} reaches {chains}"


PROBE = """
import json, sys
from dflash_hf.cli import eval, generate_labels
codes = []
for module in (eval, generate_labels):
    try:
        module.main(["--help"])
    except SystemExit as e:
        codes.append(e.code)
print(json.dumps({"codes": codes, "training": sorted(m for m in sys.modules if m.startswith("dflash_hf.training"))}))
"""


@pytest.mark.slow  # 5.4 s on 2 busy cores: a fresh interpreter loads torch and transformers
def test_the_two_commands_load_no_training_module_when_run():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    ).stdout.splitlines()[-1]
    found = json.loads(out)
    assert found["codes"] == [0, 0]  # both printed their help
    assert found["training"] == []
