"""User errors versus bugs, and how the console scripts report them (one place).

A *user error* is a setting, file or sample the user has to change; its message names it and the fix.
The console scripts (`dflash-train`, `dflash-eval`, `dflash-generate-labels`, `dflash-demo`) print such an
error as one line and exit with status 2, as argparse does. An *environment fault* (:class:`EnvironmentFault`: a
full disk, a data-loader worker killed, GPU out of memory) stopped a run that was right: one line saying what
happened, the last complete checkpoint (for `dflash-generate-labels`, :class:`OutputKeptFault`: the rows written so
far) and the command that resumes, and exit status 75
(`ENVIRONMENT_FAULT_EXIT_CODE`, sysexits' EX_TEMPFAIL: try again). Anything else is a bug and keeps its traceback.
`DFLASH_DEBUG=1` shows the traceback of user errors and faults too (`--debug` is taken: it is a `TrainingArguments`
field).

Light module: no torch, no transformers.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterable

DEBUG_ENV = "DFLASH_DEBUG"
USER_ERROR_EXIT_CODE = 2
ENVIRONMENT_FAULT_EXIT_CODE = 75  # EX_TEMPFAIL: the environment stopped a correct run; resume it (docs/RELIABILITY.md)


class DFlashUserError(ValueError):
    """A setting, file or sample the user must change; the message names it (as the user spelled it) and the fix."""


class ConfigFileError(DFlashUserError):
    """A `--config` YAML file that cannot be used: not found, malformed, wrong value types, unknown keys."""


class EnvironmentFault(Exception):
    """The run's environment stopped it: not a setting to change, not a bug. `what` says what happened and what to
    do about it; `checkpoint` is the last complete checkpoint (`saved`: of the step where the run stopped; `ended`:
    of the step at which training ended, so a resume from it trains no step and goes to the final evaluation and
    the export; None: none yet); `resume_command` is the command that resumes (set by the console script, which
    knows its command line)."""

    def __init__(self, what: str, *, checkpoint: str | None = None, saved: bool = False, ended: bool = False):
        super().__init__(what)
        self._set_fault(what, checkpoint, saved, ended)

    def _set_fault(self, what: str, checkpoint: str | None, saved: bool = False, ended: bool = False) -> None:
        """The fields `__str__` reads (also for a subclass whose other base sets the exception's args)."""
        self.what, self.checkpoint, self.saved, self.ended = what, checkpoint, saved, ended
        self.resume_command: str | None = None

    def __str__(self) -> str:
        if self.checkpoint is None:
            where, how = "No complete checkpoint was saved yet", "start the run again"
        elif self.ended:
            where = f"Training had ended and its last step is the complete checkpoint {self.checkpoint}"
            how = "resume from it (no step is trained again: the final evaluation and the export run)"
        elif self.saved:
            where = f"A complete checkpoint was saved where the run stopped: {self.checkpoint}"
            how = "resume from it"
        else:
            where = f"The last complete checkpoint is {self.checkpoint} (the steps after it are lost)"
            how = "resume from it"
        command = self.resume_command or (
            "the same command with --resume_from_checkpoint true (Python: train(resume_from_checkpoint=True))"
            if self.checkpoint
            else "the same command"
        )
        return f"{self.what}. {where}; {how}: {command}"


class OutputKeptFault(EnvironmentFault):
    """An environment fault of a command that writes its output as it goes and resumes from what it wrote
    (`dflash-generate-labels`' ``<output>.partial``), not from checkpoints: `what` says what happened, the fix, what
    of the output is kept and how to resume."""

    def __str__(self) -> str:
        return self.what


def oom_reason(error: BaseException | str) -> str:
    """torch's short reason for a GPU out-of-memory error: its first two sentences (``CUDA out of memory. Tried to
    allocate 2.00 GiB``), without the allocator's statistics and advice that follow."""
    text = str(error).strip()
    return ". ".join(text.splitlines()[0].split(". ")[:2]) if text else "torch.OutOfMemoryError"


# Every exception family the console scripts report as a user error. ValueError covers DFlashUserError,
# `dflash_hf.data.BadSampleError` and the argument checks of every dataclass `__post_init__`; the OSError
# subclasses are the missing or misplaced files and directories the user named.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


def debug_enabled() -> bool:
    """True when `DFLASH_DEBUG` is set to anything but empty, 0, false or no."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _cli_value(value: str) -> str:
    value = value.strip("'\"")
    return {"True": "true", "False": "false", "None": "none"}.get(value, value)


def cli_message(message: str, option_names: Iterable[str]) -> str:
    """Rewrite `name=value` mentions of command-line options as the flags a CLI user types
    (`skip_bad_samples=True` -> `--skip_bad_samples true`). Other text is left as it is."""
    names = sorted(set(option_names), key=len, reverse=True)
    if not names:
        return message
    pattern = re.compile(r"(?<![\w.\-])(" + "|".join(map(re.escape, names)) + r")=('[^']*'|\"[^\"]*\"|[\w.+\-/]*[\w/])")
    return pattern.sub(lambda m: f"--{m.group(1)} {_cli_value(m.group(2))}", message)


def run_console(
    main: Callable[[list[str]], int | None],
    argv: list[str] | None = None,
    *,
    prog: str | None = None,
    option_names: Callable[[], Iterable[str]] | None = None,
) -> int:
    """Run a console script's `main(argv)`; a user error becomes one line on stderr and exit status 2, an
    environment fault one line and exit status 75.
    `option_names` (called only on an error) lists the script's options, for `cli_message`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = prog or os.path.basename(sys.argv[0]) or "dflash"
    try:
        return main(argv) or 0
    except EnvironmentFault as err:
        if debug_enabled():
            raise
        print(f"{prog}: stopped: {err}\n(set {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
        return ENVIRONMENT_FAULT_EXIT_CODE
    except USER_ERRORS as err:
        if debug_enabled():
            raise
        names = option_names() if option_names is not None else ()
        text = cli_message(str(err) or type(err).__name__, names)
        print(f"{prog}: error: {text}\n(set {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
        return USER_ERROR_EXIT_CODE


__all__ = [
    "ENVIRONMENT_FAULT_EXIT_CODE",
    "ConfigFileError",
    "DFlashUserError",
    "EnvironmentFault",
    "OutputKeptFault",
    "USER_ERRORS",
    "cli_message",
    "debug_enabled",
    "oom_reason",
    "run_console",
]
