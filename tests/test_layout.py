"""The layout of the package and of its tests.

- The package's folders depend one way: cli -> training -> {generation, objective, export -> data} -> targets ->
  {models, ops}; `settings` (every default and check, light) is read by all of these but models and ops, and reads
  only the pure-Python `models/draft_fields.py` (remote code). `data` makes plain dicts of tensors (batches, the
  prompts of evaluation rows) that `generation` decodes: generation never imports data, nor data generation.
  `export` reads draft exports and their records and sets up what `dflash-eval` decodes (a draft on its target and
  the prompts `data` makes). `dflash-eval` and `dflash-generate-labels` import nothing of `training`
  (tests/cli/test_command_imports.py). `errors` (user errors) may be imported from anywhere,
  `testing` (tiny targets, which takes the serving fields of a target family from `targets`, and the demo's
  assets, whose target is taught on `data`'s loader) only from cli;
  `serving` (engine plugins, loaded by the engine) imports nothing of the package; only `export` imports it (the model
  card names what the plugin refuses, by the plugin's own rule). `lazy` (the standard-library helper every folder's
  `__init__` exports its names with, imported on first use) imports nothing of the package.
- The test tree mirrors the package's folders (plus `benchmarks/` for the scripts and `gpu/` for the CUDA tier).
- Every test path the CI script (`.ci/run`) names exists (pytest would fail on a missing one only in that stage).
- Every folder's `__init__` says what the folder is and exports its public names (`__all__`), imported on first use
  through `dflash_hf.lazy` from the folder's own modules, so importing a folder loads no torch and makes no circle
  (the registries `objective/labels` and `objective/losses` import their entries; `settings` is light anyway).
- docs/ARCHITECTURE.md's layout table names every module of the package in its folder's row (a file of a subfolder
  by its name, `base.py`, or its path from the package, `models/draft_fields.py`), and every file it names exists.
- No `_private` name crosses a module: nothing in the package, `benchmarks/` or `scripts/` imports one from another
  module of the repository or reads one as an attribute of such a module (tests may, where they poke internals).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from utils import REPO_ROOT, TESTS_DIR

PACKAGE = REPO_ROOT / "dflash_hf"
# what each folder (or top-level module) may import from the package besides itself
ALLOWED = {
    "errors": set(),
    "lazy": set(),
    "models": set(),
    "ops": set(),
    "testing": {"targets", "data"},  # tiny targets carry their family's serving fields; the demo's learns on a loader
    "serving": set(),  # engine plugins: imported by the engine (an entry point) and by the model card (export)
    "settings": {"models"},  # only models/draft_fields.py (test_settings_read_only_the_pure_python_draft_fields)
    "targets": {"settings", "models", "ops", "errors"},
    "data": {"settings", "targets", "models", "ops", "errors"},
    "objective": {"settings", "targets", "models", "ops", "errors"},
    "generation": {"settings", "targets", "models", "ops", "errors"},
    "export": {"data", "settings", "targets", "models", "ops", "errors", "serving"},
    "training": {"generation", "objective", "data", "export", "settings", "targets", "models", "ops", "errors"},
    "cli": {
        "training",
        "generation",
        "objective",
        "data",
        "export",
        "settings",
        "targets",
        "models",
        "ops",
        "errors",
        "testing",
    },
}
TEST_FOLDERS = {p for p in ALLOWED if (PACKAGE / p).is_dir()} | {"benchmarks", "gpu"}


def _package_imports(path) -> set[str]:
    """The package folders (or top-level modules) that `path` imports, lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "dflash_hf" else [f"dflash_hf.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found |= {n.split(".")[1] for n in names if n.startswith("dflash_hf.")}
    return found


def _folder_of(path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


def test_package_folders_depend_one_way():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        folder = _folder_of(path)
        if folder == "__init__":
            continue  # the public API re-exports from below
        assert folder in ALLOWED, f"{path}: a new folder needs its place in ALLOWED"
        deps = _package_imports(path) - {folder}
        if path.name == "__init__.py":
            deps -= {"lazy"}  # a folder's public names, imported on first use
        for dep in deps:
            if dep not in ALLOWED[folder]:
                wrong.append(f"{path.relative_to(REPO_ROOT)} imports dflash_hf.{dep}")
    assert not wrong, "\n".join(wrong)


def test_remote_code_files_import_only_torch_transformers_and_each_other():
    """The files an export copies; `models/__init__.py` is not one of them (its lazy exports import `lazy`)."""
    files = sorted((PACKAGE / "models").glob("*.py"))
    assert PACKAGE / "models" / "__init__.py" in files
    for path in files:
        expected = {"lazy"} if path.name == "__init__.py" else set()
        assert _package_imports(path) == expected, path.name


def test_settings_read_only_the_pure_python_draft_fields():
    """The settings stay light: of the package they import `models.draft_fields` alone (remote code that imports
    nothing but the standard library), never the config or the model."""
    draft_fields = PACKAGE / "models" / "draft_fields.py"
    stdlib_only = {"__future__", "collections", "dataclasses"}
    tree = ast.parse(draft_fields.read_text())
    assert {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} <= stdlib_only
    for path in sorted((PACKAGE / "settings").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_hf.models"):
                assert node.module == "dflash_hf.models.draft_fields", f"{path.name} imports {node.module}"


def test_test_tree_mirrors_the_package():
    dirs = {p.parent.relative_to(TESTS_DIR).parts[0] for p in TESTS_DIR.rglob("test_*.py") if p.parent != TESTS_DIR}
    assert dirs <= TEST_FOLDERS, sorted(dirs - TEST_FOLDERS)
    assert sorted(p.name for p in TESTS_DIR.glob("test_*.py")) == [
        "test_layout.py",
        "test_references.py",
        "test_repository_text.py",
    ]


def test_every_test_path_the_ci_script_names_exists():
    script = (REPO_ROOT / ".ci" / "run").read_text()
    named = set(re.findall(r"(?<![\w/.-])tests(?:/[\w.-]+)*", script))
    assert "tests/serving" in named  # the parse finds the serving stage's paths
    missing = sorted(path for path in named if not (REPO_ROOT / path).exists())
    assert not missing, f".ci/run names test paths that do not exist: {missing}"


CODE_FOLDERS = ("dflash_hf", "benchmarks", "scripts")


def _is_repo_module(module: str | None, level: int, path) -> bool:
    """Whether `from <module> import ...` (relative when `level`) in `path` names a module of this repository."""
    if level:
        return True
    top = (module or "").split(".")[0]
    places = {path.parent, *(REPO_ROOT / folder for folder in CODE_FOLDERS[1:])}
    return top == "dflash_hf" or any((p / f"{top}.py").is_file() or (p / top).is_dir() for p in places)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_crossings(path) -> list[str]:
    tree = ast.parse(path.read_text())
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _is_repo_module(node.module, node.level, path):
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"imports {alias.name} from {'.' * node.level}{node.module or ''}")
                else:
                    modules.add(alias.asname or alias.name)  # a module imported by name, or any other name
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name.split(".")[0] for a in node.names if _is_repo_module(a.name, 0, path)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"reads {ast.unparse(node)}")
    return [f"{path.relative_to(REPO_ROOT)}:{node}" for node in found]


def test_no_private_name_crosses_a_module():
    """A name another module uses is public (renamed, not re-exported under a `_private` alias): the seams are the
    names without an underscore."""
    found = []
    for folder in CODE_FOLDERS:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            found += _private_crossings(path)
    assert not found, "\n".join(found)


EAGER_INITS = {"objective/labels", "objective/losses", "settings"}  # registries and the light settings
NO_EXPORTS = {"cli", "serving"}  # commands; the engine plugin (loaded by the engine)


def _lazy_map(tree: ast.Module) -> dict[str, list[str]] | None:
    """The `{module: [names]}` a package's `__init__` hands `lazy_exports`, None when it calls none."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports":
            return ast.literal_eval(node.args[1])
    return None


def test_every_folder_init_exports_its_public_names_lazily():
    from test_references import top_level_names

    problems = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        folder = init.parent.relative_to(PACKAGE).as_posix()
        tree = ast.parse(init.read_text())
        if not ast.get_docstring(tree):
            problems.append(f"{folder}: no docstring saying what the folder is")
        if folder in NO_EXPORTS | EAGER_INITS:
            continue
        exports = _lazy_map(tree)
        if not exports or "__all__" not in top_level_names(init):
            problems.append(f"{folder}: no __all__ from lazy_exports")
            continue
        for module, names in exports.items():
            path = init.parent.joinpath(*module.lstrip(".").split("."))
            file = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
            if folder != "." and module.startswith(".."):
                problems.append(f"{folder}: exports {module}, not a module of its own")
            elif not file.is_file():
                problems.append(f"{folder}: no module {module}")
            else:
                problems += [f"{folder}: {module} defines no {n}" for n in names if n not in top_level_names(file)]
        typed = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING"]
        typing_only = {id(n) for block in typed for n in ast.walk(block)}
        runtime = [n for n in ast.walk(tree) if id(n) not in typing_only]
        imports = {n.module for n in runtime if isinstance(n, ast.ImportFrom)}
        imports |= {a.name for n in runtime if isinstance(n, ast.Import) for a in n.names}
        if imports - {"__future__", "typing", "dflash_hf.lazy"}:
            problems.append(f"{folder}: imports {sorted(imports)} when imported")
        # names imported for type checkers only are the exported ones, from the same modules
        for n in (n for block in typed for n in ast.walk(block) if isinstance(n, ast.ImportFrom)):
            for alias in n.names:
                source = {name: m for m, names in exports.items() for name in names}.get(alias.name)
                if source is None or not n.module.endswith(source.lstrip(".")):
                    problems.append(f"{folder}: TYPE_CHECKING imports {alias.name} from {n.module}, not its export")
    assert not problems, "\n".join(problems)


def test_no_folder_exports_a_name_of_its_own_submodules():
    """A lazily exported name that is also a submodule's name makes `package.name` the module or the object
    depending on import order (importing the submodule sets the package attribute)."""
    clashes = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        exports = _lazy_map(ast.parse(init.read_text())) or {}
        submodules = {p.stem for p in init.parent.glob("*.py")} | {p.name for p in init.parent.iterdir() if p.is_dir()}
        clashes += [f"{init.parent.name}.{n}" for names in exports.values() for n in names if n in submodules]
    assert not clashes, clashes


def test_importing_every_folder_loads_no_torch():
    folders = sorted(
        p.parent.relative_to(REPO_ROOT).as_posix().replace("/", ".")
        for p in PACKAGE.rglob("__init__.py")
        if p.parent.relative_to(PACKAGE).as_posix() not in EAGER_INITS - {"settings"}
    )
    probe = f"import sys; import {', '.join(folders)}; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert out.stdout.strip() == "[]", (folders, out.stdout[-500:])


def _layout_rows() -> dict[str, str]:
    """docs/ARCHITECTURE.md's layout table: folder (`dflash_hf` for the top-level modules) -> its row's text."""
    text = (REPO_ROOT / "docs" / "ARCHITECTURE.md").read_text()
    return {m[0]: m[1] for m in re.findall(r"^\| `([\w/]+)/` \| (.*) \|$", text, flags=re.MULTILINE)}


def test_the_architecture_table_lists_every_module_and_only_existing_ones():
    rows = _layout_rows()
    assert {"dflash_hf", "targets", "serving", "generation"} <= set(rows)  # the parse finds the table
    missing, stale = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if path.name == "__init__.py" and len(rel.parts) > 1:
            continue  # a folder's face, described by the folder's row
        row = rows.get(rel.parts[0] if len(rel.parts) > 1 else "dflash_hf", "")
        if f"`{path.name}`" not in row and f"`{rel.as_posix()}`" not in row:
            missing.append(rel.as_posix())
    for folder, row in rows.items():
        base = PACKAGE if folder == "dflash_hf" else PACKAGE / folder
        for name in re.findall(r"`([\w/]+\.py)`", row):
            if not (PACKAGE / name).is_file() and not any(base.rglob(name)):
                stale.append(f"{folder}: {name}")
    assert not missing, f"modules docs/ARCHITECTURE.md's table does not list: {missing}"
    assert not stale, f"files docs/ARCHITECTURE.md's table names that do not exist: {stale}"
