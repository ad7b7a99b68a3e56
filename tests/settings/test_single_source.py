"""Every DFlash default is written once: the options of `dflash-train` (both parsers) default to the settings' values
(`dflash_hf.settings`), and no module of the package writes a second literal for a setting, under its name, outside
the settings (`dflash_hf/settings/` and the remote-code `models/draft_fields.py` they read)."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys

from utils import REPO_ROOT

from dflash_hf.cli import options
from dflash_hf.cli import train as cli_train
from dflash_hf.cli.config import option_actions
from dflash_hf.settings import TRAINER_OVERRIDES, TRAINING_SETTINGS, DataSettings, ObjectiveSettings

PACKAGE = REPO_ROOT / "dflash_hf"
SOURCES = (PACKAGE / "settings", PACKAGE / "models" / "draft_fields.py")  # where a default may be written
OPTION_SETTINGS = (*TRAINING_SETTINGS, DataSettings)
# A parameter that shares a setting's name but not its meaning: (file, name) -> why its literal is its own.
OTHER_MEANING = {
    ("dflash_hf/targets/families/registry.py", "padding_side"): "encode_batch pads the batch it is handed",
    ("dflash_hf/data/eval_rows.py", "padding_side"): "prompts are decoded one at a time",
    ("dflash_hf/testing/demo_assets.py", "max_tokens"): "teaching the demo's tiny target, not a training batch",
}


def _settings_defaults() -> dict[str, object]:
    out = {}
    for cls in OPTION_SETTINGS:
        for f in dataclasses.fields(cls):
            out[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return out | {name: default for name, (default, _) in TRAINER_OVERRIDES.items()}


def test_every_option_defaults_to_the_settings_value():
    expected = _settings_defaults()
    for parser in (cli_train.make_parser(), options.help_parser()):
        actions = option_actions(parser)
        assert set(expected) <= set(actions), sorted(set(expected) - set(actions))
        wrong = {n: (actions[n].default, v) for n, v in expected.items() if actions[n].default != v}
        assert not wrong, wrong  # option -> (its default, the settings')


def _literal(node: ast.AST | None) -> bool:
    """A literal value other than None (a number, string or bool, a negative number, a tuple or list of them)."""
    if isinstance(node, ast.Constant):
        return node.value is not None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _literal(node.operand)
    return isinstance(node, (ast.Tuple, ast.List)) and bool(node.elts) and all(map(_literal, node.elts))


def _field_default(value: ast.AST | None) -> ast.AST | None:
    """The default of `name: T = value` in a class body: the value, or the default of `field(...)` / `setting(...)`."""
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) in ("field", "setting"):
        keywords = {k.arg: k.value for k in value.keywords}
        if "default" in keywords:
            return keywords["default"]
        return value.args[0] if value.args and value.func.id == "setting" else None
    return value


def literal_defaults(tree: ast.AST, names: set[str]) -> list[tuple[str, int]]:
    """(setting name, line) of each literal written as a default of a setting in `tree`: a field or parameter of that
    name, a `DEFAULT_<NAME>` constant, or the fallback of `getattr(x, "name", ...)` / `x.get("name", ...)`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    if item.target.id in names and _literal(_field_default(item.value)):
                        found.append((item.target.id, item.lineno))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            found += [(a.arg, d.lineno) for a, d in pairs if a.arg in names and _literal(d)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                name = getattr(target, "id", "")
                if name.startswith("DEFAULT_") and name[8:].lower() in names and _literal(node.value):
                    found.append((name[8:].lower(), node.lineno))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            getter = getattr(node.func, "id", None) == "getattr" or getattr(node.func, "attr", None) == "get"
            key = node.args[-2] if getattr(node.func, "id", None) == "getattr" else node.args[0]
            if getter and isinstance(key, ast.Constant) and key.value in names and _literal(node.args[-1]):
                found.append((key.value, node.lineno))
    return found


def test_each_default_is_written_once():
    names = set(_settings_defaults())
    in_settings: dict[str, list[str]] = {}
    elsewhere = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = in_settings if any(path == s or s in path.parents for s in SOURCES) else None
        relative = str(path.relative_to(REPO_ROOT))
        for name, line in literal_defaults(ast.parse(path.read_text()), names):
            if (relative, name) in OTHER_MEANING:
                continue
            spot = f"{relative}:{line} ({name})"
            if where is None:
                elsewhere.append(spot)
            else:
                where.setdefault(name, []).append(spot)
    assert not elsewhere, "defaults written outside dflash_hf/settings:\n" + "\n".join(elsewhere)
    twice = {name: spots for name, spots in in_settings.items() if len(spots) > 1}
    assert not twice, twice


def test_the_scan_finds_a_second_literal():
    """The scan of `test_each_default_is_written_once` sees each way a default is written again."""
    source = """
class Objective:
    anchor_pad_multiple: int = 1
    ce_chunk_size: int = field(default=1024)
    num_anchors: int | None = setting(64, "...")
    gamma: float | None = None

def plan(batch, num_anchors=512, *, label_top_k: int = -4, packing=None): ...
DEFAULT_DPACE_ALPHA = 0.5
chunk = getattr(source, "target_argmax_chunk_size", 128)
side = options.get("padding_side", "left")
"""
    names = {"anchor_pad_multiple", "ce_chunk_size", "num_anchors", "gamma", "label_top_k", "packing"}
    names |= {"dpace_alpha", "target_argmax_chunk_size", "padding_side"}
    found = {name for name, _ in literal_defaults(ast.parse(source), names)}
    assert found == names - {"gamma", "packing"}  # None is "unset", not a default value


def test_anchor_pad_multiple_is_one_value_for_dflash_train_and_the_objective(tmp_path):
    from utils import make_args

    assert make_args(tmp_path).anchor_pad_multiple == ObjectiveSettings().anchor_pad_multiple == 8


def test_the_objective_its_label_sources_and_losses_have_no_defaults_of_their_own():
    """They are built from `ObjectiveSettings` (`DFlashObjective.from_settings`, `make_label_source`, `make_loss`)."""
    from dflash_hf.objective.dflash_objective import DFlashObjective
    from dflash_hf.objective.labels import LABEL_SOURCES
    from dflash_hf.objective.losses import LOSSES

    for cls in (DFlashObjective, *LABEL_SOURCES.values(), *LOSSES.values()):
        defaulted = [f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING]
        assert not defaulted, (cls.__name__, defaulted)
        factories = [f.name for f in dataclasses.fields(cls) if f.default_factory is not dataclasses.MISSING]
        assert not factories, (cls.__name__, factories)


def test_settings_import_no_torch_or_transformers():
    code = "import sys, dflash_hf.settings; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    assert out.stdout.strip() == "[]"
