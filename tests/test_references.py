"""References in the repository's text resolve: every repository file path (`dflash_hf/data/loader.py`,
`benchmarks/train_step.py`, `docs/DATA.md`) and every dotted package name
(`dflash_hf.data.loader.build_train_dataloader`) written in a doc, a docstring, a comment or a script names something
that exists, so moving a module cannot leave its old name behind."""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

from utils import REPO_ROOT

TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".sh"}
PATH_REF = re.compile(
    r"(?<![\w./-])((?:dflash_hf|benchmarks|scripts|tests|docs|examples)/[\w./-]*\w\.(?:py|md|yaml|json))"
)
DOTTED_REF = re.compile(r"(?<![\w.])(dflash_hf(?:\.\w+)+)")
PLACEHOLDER = re.compile(r"[A-Z]{2,}|<|\*|\{")  # docs/results/NAME.json, benchmarks/NAME.py: patterns, not paths
# what a command writes (`--out docs/results/x.json`), a file of an older commit (`git show REV:path`), a logger's name
NOT_A_REFERENCE = re.compile(r"--(?:out|json)[ =](\S+)|git show \w+:(\S+)|getLogger\(\"([\w.]+)\"\)")


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    files = [REPO_ROOT / name for name in out.splitlines()]
    return [f for f in files if (f.suffix in TEXT_SUFFIXES or f.name == "run") and f.is_file()]


@cache
def top_level_names(module_file: Path) -> frozenset[str]:
    """Names a module defines or imports at its top level (what `module.name` can refer to)."""
    names: set[str] = set()
    tree = ast.parse(module_file.read_text())
    for node in ast.walk(tree):  # a package's `__all__`: a list, or `lazy_exports`'s of the names it maps
        assigned = {n.id for t in getattr(node, "targets", ()) for n in ast.walk(t) if isinstance(n, ast.Name)}
        if isinstance(node, ast.Assign) and "__all__" in assigned:
            lists = [v for v in ast.walk(node.value) if isinstance(v, ast.List)]
            names.update(c.value for v in lists for c in v.elts if isinstance(c, ast.Constant))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return frozenset(names)


@cache
def class_members(module_file: Path, cls: str) -> frozenset[str]:
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            names = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
            for n in node.body:
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    names.add(n.target.id)
                elif isinstance(n, ast.Assign):
                    names.update(t.id for t in n.targets if isinstance(t, ast.Name))
            return frozenset(names)
    return frozenset()


def dotted_problem(ref: str) -> str | None:
    """None when `ref` names a package, a module, or a name (or a class member) defined in one."""
    parts = ref.split(".")
    path = REPO_ROOT
    for i, part in enumerate(parts):
        if (path / part).is_dir() and (path / part / "__init__.py").is_file():
            path = path / part
            continue
        if (path / f"{part}.py").is_file():
            module, rest = path / f"{part}.py", parts[i + 1 :]
        elif i > 0:
            module, rest = path / "__init__.py", parts[i:]
        else:
            return "no such package"
        if not rest:
            return None
        if rest[0] not in top_level_names(module):
            return f"{module.relative_to(REPO_ROOT)} defines no {rest[0]!r}"
        if len(rest) > 1 and class_members(module, rest[0]) and rest[1] not in class_members(module, rest[0]):
            return f"{rest[0]} in {module.relative_to(REPO_ROOT)} has no {rest[1]!r}"
        return None
    return None


def test_repository_references_resolve():
    problems = []
    for file in tracked_text_files():
        rel = file.relative_to(REPO_ROOT)
        if rel.parts[0] == "docs" and rel.parts[1:2] == ("results",):
            continue  # raw results record the command lines of their time
        for lineno, line in enumerate(file.read_text(errors="replace").splitlines(), 1):
            line = NOT_A_REFERENCE.sub("", line)
            for ref in PATH_REF.findall(line):
                if not PLACEHOLDER.search(ref.split("/")[-1].rsplit(".", 1)[0]) and not (REPO_ROOT / ref).exists():
                    problems.append(f"{rel}:{lineno}: {ref} does not exist")
            for ref in DOTTED_REF.findall(line):
                problem = dotted_problem(ref.rstrip("."))
                if problem:
                    problems.append(f"{rel}:{lineno}: {ref}: {problem}")
    assert not problems, "stale references:\n" + "\n".join(problems)
