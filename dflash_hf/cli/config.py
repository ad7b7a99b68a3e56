"""`--config file.yaml` plus command-line overrides for `HfArgumentParser` dataclasses (README)."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from transformers import HfArgumentParser


def parse_with_config(parser: HfArgumentParser, argv: list[str] | None = None) -> tuple:
    """Parse `argv` into the parser's dataclasses. Values from `--config FILE.yaml` (a flat mapping of
    field names) become defaults, so any flag given on the command line overrides them."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    if known.config:
        path = Path(known.config)
        if not path.is_file():
            raise FileNotFoundError(f"--config {known.config!r} does not exist; give a YAML file of field: value")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"--config {known.config!r} must hold a mapping of field: value, got {type(values)}")
        dests = {a.dest: a for a in parser._actions}
        unknown = sorted(k for k in values if k not in dests)
        if unknown:
            raise ValueError(f"--config {known.config!r} has unknown fields {unknown}; see --help for the valid ones")
        for key in values:
            dests[key].required = False
        parser.set_defaults(**values)
    return parser.parse_args_into_dataclasses(args=rest, look_for_args_file=False)
