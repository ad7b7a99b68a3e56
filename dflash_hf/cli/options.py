"""`dflash-train`'s option list without torch: help and argument errors in well under a second or two.

The DFlash groups come from the light dataclasses of `dflash_hf.training.argument_groups` (through
`HfArgumentParser`, as the
real parser makes them). The inherited `TrainingArguments` options are read from transformers' source file
(`ast`, nothing imported: importing it loads torch, peft and accelerate, seconds of CPU) and listed after them,
one group per section of that file. They are placeholders: they take any value, which the real parser checks
once the heavy stack is loaded. When the source cannot be read this way, `help_parser` returns None and the real
parser answers (slower, same options).
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from dflash_hf.cli.config import add_config_option
from dflash_hf.settings import TRAINER_OVERRIDES
from dflash_hf.training.argument_groups import HELP_GROUPS, LATE_HELP_GROUPS

PROG = "dflash-train"
DESCRIPTION = (
    "Train (or only validate) a DFlash / DFlash2 draft against a frozen target, then export it. "
    "Options are grouped: the main DFlash groups first, then the inherited transformers TrainingArguments, then "
    "the DFlash advanced tuning knobs (the defaults suit most runs) and the experimental features. "
    "Every option can also be set in a --config YAML file."
)
USAGE = f"{PROG} [--config FILE.yaml] [--OPTION VALUE ...]"
SECTION = re.compile(r"^\s*# --- (.+?) ---\s*$")


@dataclass(frozen=True)
class TrainerOption:
    """One `TrainingArguments` field as its source declares it."""

    name: str
    section: str
    help: str
    default: object
    flag: bool  # a bool field: `--name` alone means true
    multiple: bool  # a list field: several values


def _literal(node: ast.AST | None, fallback: object = None) -> object:
    """The value of a literal expression; `argparse.SUPPRESS` (shown as no default) for anything computed."""
    if node is None:
        return fallback
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return argparse.SUPPRESS


def _field_parts(value: ast.AST | None) -> tuple[object, str, bool]:
    """(default, help, init) of a `name: T = field(...)` or `name: T = default` declaration."""
    if not (isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field"):
        return _literal(value), "", True
    kwargs = {k.arg: k.value for k in value.keywords}
    default = _literal(kwargs.get("default"))
    if "default_factory" in kwargs:
        factory = kwargs["default_factory"]
        default = _literal(factory.body) if isinstance(factory, ast.Lambda) else argparse.SUPPRESS
    metadata = _literal(kwargs.get("metadata"), {})
    help_text = metadata.get("help", "") if isinstance(metadata, dict) else ""
    init = _literal(kwargs.get("init"), True) is not False  # a computed `init=` counts as an init field
    return default, help_text if isinstance(help_text, str) else "", init


def read_trainer_options(path: Path) -> list[TrainerOption]:
    """The init fields of `class TrainingArguments` in `path`, each with the `# --- Section ---` it is under."""
    source = path.read_text()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "TrainingArguments")
    headers = [(i, m.group(1)) for i, line in enumerate(source.splitlines(), 1) if (m := SECTION.match(line))]
    options = []
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        default, help_text, init = _field_parts(node.value)
        if name.startswith("_") or not init:
            continue
        section = next((title for line, title in reversed(headers) if line < node.lineno), "Other")
        annotation = ast.unparse(node.annotation)
        if name in TRAINER_OVERRIDES:
            default, help_text = TRAINER_OVERRIDES[name]
        options.append(
            TrainerOption(
                name=name,
                section=section,
                help=help_text,
                default=default,
                flag=re.search(r"\bbool\b", annotation) is not None,
                multiple="list[" in annotation,
            )
        )
    known = {o.name for o in options}
    for name, (default, help_text) in TRAINER_OVERRIDES.items():  # DFlash fields that this version lacks
        if name not in known:
            options.append(TrainerOption(name, "Other", help_text, default, isinstance(default, bool), False))
    return options


@functools.cache
def trainer_options() -> tuple[TrainerOption, ...] | None:
    """`TrainingArguments` options of the installed transformers, or None when its source cannot be read."""
    spec = importlib.util.find_spec("transformers")  # locates the package, imports nothing
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        options = read_trainer_options(Path(list(spec.submodule_search_locations)[0]) / "training_args.py")
    except (OSError, SyntaxError, StopIteration):
        return None
    return tuple(options) or None


def _add_placeholder(group: argparse._ArgumentGroup, option: TrainerOption) -> None:
    names = [f"--{option.name}"] + ([f"--{option.name.replace('_', '-')}"] if "_" in option.name else [])
    nargs = "?" if option.flag else ("*" if option.multiple else None)
    help_text = option.help.replace("%", "%%")
    action = group.add_argument(*names, nargs=nargs, default=option.default, help=help_text or None)
    action.unchecked = True  # any value: the real parser checks it (cli.config.check_value skips it)
    if option.flag and option.default is True:
        complement = group.add_argument(
            f"--no_{option.name}",
            f"--no-{option.name.replace('_', '-')}",
            nargs=0,
            action=_NoValue,
            dest=option.name,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
        complement.unchecked = True


class _NoValue(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, False)


def help_parser():
    """The parser `dflash-train --help` prints and that checks the command line before anything heavy loads:
    `--config`, the main DFlash groups (real options), the TrainingArguments sections (placeholders), then the
    DFlash advanced and experimental groups. None when transformers' source cannot be read (the real parser then
    answers)."""
    options = trainer_options()
    if options is None:
        return None
    from transformers import HfArgumentParser  # the argparse helper only: no torch

    parser = HfArgumentParser(HELP_GROUPS, prog=PROG, usage=USAGE, description=DESCRIPTION)
    add_config_option(parser)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in options:
        if option.section not in groups:
            groups[option.section] = parser.add_argument_group(f"TrainingArguments: {option.section}")
        _add_placeholder(groups[option.section], option)
    for group in LATE_HELP_GROUPS:
        parser._add_dataclass_arguments(group)
    return parser
