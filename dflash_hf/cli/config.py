"""`--config file.yaml` plus command-line overrides for `HfArgumentParser` dataclasses (README).

The YAML file is a flat mapping of field names. Its values are checked against the parser's options (type,
list or scalar, choices) and become defaults, so any flag given on the command line overrides them. Every
problem names the file, the line and the field. Light module: no torch.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from dflash_hf.errors import ConfigFileError

CONFIG_HELP = (
    "YAML file of `field: value` defaults (any option below); flags given on the command line override it. "
    "See examples/configs/."
)


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """Document `--config` in the parser's help (it is read by `parse_with_config` before the parser runs)."""
    if "--config" not in parser._option_string_actions:
        parser.add_argument("--config", metavar="FILE.yaml", default=argparse.SUPPRESS, help=CONFIG_HELP)


def split_config(argv: list[str] | None) -> tuple[str | None, list[str]]:
    """(`--config` value or None, the other arguments)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    return known.config, rest


def option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> the option that sets it (the first one: `--no_x` complements share the dest of `--x`)."""
    actions: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.option_strings and action.dest not in (argparse.SUPPRESS, "help", "config"):
            actions.setdefault(action.dest, action)
    return actions


def _load_mapping(path: Path, name: str) -> dict[str, tuple[Any, int]]:
    """key -> (value, line) of a flat YAML mapping; malformed YAML names the file and line."""
    try:
        text = path.read_text()
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigFileError(f"--config {name}:{where} is not valid YAML ({problem}); fix the file") from err
    if node is None:
        return {}
    if not isinstance(node, yaml.MappingNode):
        raise ConfigFileError(
            f"--config {name} must hold a mapping of `field: value` lines, got a YAML {node.id} "
            f"(line {node.start_mark.line + 1})"
        )
    values: dict[str, tuple[Any, int]] = {}
    loader = yaml.SafeLoader("")
    for key_node, value_node in node.value:
        line = key_node.start_mark.line + 1
        key = _construct(loader, key_node, name)
        if not isinstance(key, str):
            raise ConfigFileError(f"--config {name} line {line}: key {key!r} is not a field name")
        if key in values:
            raise ConfigFileError(
                f"--config {name} line {line}: {key} is set twice (first on line {values[key][1]}); keep one"
            )
        values[key] = (_construct(loader, value_node, name), line)
    return values


def _construct(loader: yaml.SafeLoader, node: yaml.Node, name: str) -> Any:
    """A node's plain YAML value. Tags that would build Python objects (`!!python/...`) or any other tag the safe
    loader does not know are refused, naming the line: a config file holds only plain values."""
    try:
        return loader.construct_object(node, deep=True)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or node.start_mark
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigFileError(
            f"--config {name} line {mark.line + 1}: {problem}; a config file holds only plain values (numbers, "
            "strings, booleans, lists, mappings), not Python objects (`!!python/...` tags): remove the tag"
        ) from err


# String options whose values include the words true / false (YAML reads those as booleans).
BOOLEAN_WORD_OPTIONS = frozenset({"resume_from_checkpoint"})


def _type_name(value: Any) -> str:
    """`value`'s YAML type with its article ("an integer", "a list")."""
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}
    names[dict] = "a mapping"
    return names.get(type(value), f"a {type(value).__name__}")


def _scalar(value: Any, action: argparse.Action, where: str) -> Any:
    """One YAML scalar as the option's type would parse it from the command line, or a ConfigFileError."""
    kind: Callable | None = action.type
    expected = {"int": "integer", "float": "number", "string_to_bool": "boolean (true or false)"}.get(
        getattr(kind, "__name__", ""), "value"
    )
    if isinstance(value, str) and kind not in (None, str):
        try:
            value = kind(value)  # as if given on the command line
        except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
            raise ConfigFileError(f"{where}: {value!r} is not a valid {expected} ({err})") from err
    elif kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigFileError(f"{where}: {value!r} is {_type_name(value)}; give an integer")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigFileError(f"{where}: {value!r} is {_type_name(value)}; give a number")
        value = float(value)
    elif expected.startswith("boolean") and not isinstance(value, bool):
        raise ConfigFileError(f"{where}: {value!r} is {_type_name(value)}; give true or false")
    elif kind is str or kind is None:
        if isinstance(value, bool) and action.dest in BOOLEAN_WORD_OPTIONS:
            value = "true" if value else "false"
        elif isinstance(value, bool):
            raise ConfigFileError(
                f'{where}: YAML read {value!r} as a boolean; quote the value if it is a word (e.g. "no")'
            )
        if isinstance(value, (int, float)):
            value = str(value)
        elif isinstance(value, list):
            raise ConfigFileError(f"{where}: a list where one value is expected")
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(str(c) for c in action.choices)
        hint = " (YAML reads yes/no/on/off as booleans: quote the word)" if isinstance(value, bool) else ""
        raise ConfigFileError(f"{where}: {value!r} is not one of {choices}{hint}")
    return value


def check_value(key: str, value: Any, action: argparse.Action, where: str) -> Any:
    """A YAML value converted to what the option `key` takes (list or scalar of its type), or a ConfigFileError."""
    if getattr(action, "unchecked", False):
        return value  # a placeholder of the light parser (cli.options): the real parser checks it
    if value is None:
        if action.default is None:
            return None
        raise ConfigFileError(f"{where}: {key} is empty (null); give a value or drop the line")
    if action.nargs in ("+", "*"):
        if not isinstance(value, list):
            raise ConfigFileError(
                f"{where}: {value!r} is {_type_name(value)}; {key} takes a list, e.g. `{key}: [{value}]`"
            )
        if action.nargs == "+" and not value:
            raise ConfigFileError(f"{where}: {key} is an empty list; give at least one value or drop the line")
        return [_scalar(v, action, f"{where} (item {i})") for i, v in enumerate(value)]
    if isinstance(value, dict) and (action.type is str or action.type is None):
        return value  # dict-valued Trainer fields (lr_scheduler_kwargs, ...) take a mapping or a JSON string
    if isinstance(value, dict):
        raise ConfigFileError(f"{where}: {key} takes one value, got a mapping")
    return _scalar(value, action, where)


def _did_you_mean(name: str, candidates) -> str:
    """`; did you mean X?` with the candidate X closest to `name` (one that `name` abbreviates first), or nothing."""
    longer = [c for c in candidates if c.startswith(name)]
    close = difflib.get_close_matches(name, longer or list(candidates), n=1, cutoff=0 if longer else 0.6)
    return f"; did you mean {close[0]}?" if close else ""


def check_option_names(parser: argparse.ArgumentParser, args: list[str]) -> None:
    """Refuse a command-line option that `parser` does not have, naming the closest one, as argparse refuses a bad
    option (usage, the message, exit status 2). Abbreviations are refused too (argparse would take `--mask_token` for
    `--mask_token_id`): an option is spelled out in full."""
    parser.allow_abbrev = False
    options = [name for name in parser._option_string_actions if name.startswith("--")]
    for arg in args:
        if arg == "--":  # what follows is positional
            break
        name = arg.split("=", 1)[0]
        if not arg.startswith("--") or " " in arg or name in parser._option_string_actions:
            continue  # a value (argparse reads a token holding a space as one), or a known option
        spelled_out = " (options are not abbreviated)" if any(o.startswith(name) for o in options) else ""
        parser.error(f"unknown option {name}{spelled_out}{_did_you_mean(name, options)}")


def read_config(actions: dict[str, argparse.Action], config: str) -> dict[str, Any]:
    """Field values of a `--config` file, each checked against the option of the same name (`option_actions`)."""
    path = Path(config)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigFileError(f"--config {config} {what}; give a YAML file of `field: value` lines")
    raw = _load_mapping(path, config)
    unknown = sorted(k for k in raw if k not in actions)
    if unknown:
        lines = ", ".join(f"{k} (line {raw[k][1]}{_did_you_mean(k, actions)})" for k in unknown)
        raise ConfigFileError(f"--config {config} has unknown fields {lines}; see --help for the valid ones")
    return {
        key: check_value(key, value, actions[key], f"--config {config} line {line}: {key}")
        for key, (value, line) in raw.items()
    }


def apply_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> list[str]:
    """Read `--config` (if given) into the parser's defaults; returns the remaining command-line arguments, whose
    option names are checked (`check_option_names`)."""
    add_config_option(parser)
    config, rest = split_config(argv)
    check_option_names(parser, rest)
    if config:
        actions = option_actions(parser)
        values = read_config(actions, config)
        for key in values:
            actions[key].required = False
        parser.set_defaults(**values)
    return rest


def parse_with_config(parser, argv: list[str] | None = None) -> tuple:
    """Parse `argv` into the parser's dataclasses. Values from `--config FILE.yaml` (a flat mapping of
    field names) become defaults, so any flag given on the command line overrides them."""
    rest = apply_config(parser, argv)
    return parser.parse_args_into_dataclasses(args=rest, look_for_args_file=False)
