"""Console-script entry points: each runs its command's `main(argv)` under `errors.run_console`, so a user
error is one line on stderr and exit status 2 (`DFLASH_DEBUG=1` keeps the traceback).

Light module: a command's own module (and torch with it) is imported only when the command runs.
"""

from __future__ import annotations

import importlib
import sys

from dflash_hf.errors import run_console

COMMANDS = {
    "dflash-train": "dflash_hf.cli.train",
    "dflash-eval": "dflash_hf.cli.eval",
    "dflash-generate-labels": "dflash_hf.cli.generate_labels",
    "dflash-demo": "dflash_hf.cli.demo",
}


def _option_names(module) -> list[str]:
    """The module's own `option_names()` (light) when it has one, else its parser's options."""
    if hasattr(module, "option_names"):
        return module.option_names()
    from dflash_hf.cli.config import option_actions

    return list(option_actions(module.make_parser()))


def run_command(prog: str, argv: list[str] | None = None) -> int:
    """Run console script `prog` (a key of `COMMANDS`) on `argv` (default `sys.argv[1:]`); its exit status."""
    state = {}

    def main(args: list[str]):
        state["module"] = module = importlib.import_module(COMMANDS[prog])
        return module.main(args)

    def names():
        return _option_names(state["module"]) if "module" in state else []

    return run_console(main, argv, prog=prog, option_names=names)


def train() -> None:
    sys.exit(run_command("dflash-train"))


def evaluate() -> None:
    sys.exit(run_command("dflash-eval"))


def generate_labels() -> None:
    sys.exit(run_command("dflash-generate-labels"))


def demo() -> None:
    sys.exit(run_command("dflash-demo"))
