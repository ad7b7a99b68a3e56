"""What every results JSON of the benchmarks records (the commit, the command line, the device) and how it is
written."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def git_commit() -> str:
    """The checkout's commit (`+dirty` with uncommitted changes); `DFLASH_COMMIT` when set (a copy of the tree
    without its git history, e.g. an offline bundle, names its commit this way)."""
    if os.environ.get("DFLASH_COMMIT"):
        return os.environ["DFLASH_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):  # a copy without .git (the device): what the caller says
        return os.environ.get("DFLASH_COMMIT", "unknown")
    return head + ("+dirty" if dirty else "")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def command_line(script: Path, argv: list[str] | None) -> str:
    """The command a results JSON records: this process's, or the script's with `argv` (a call from Python)."""
    return shlex.join([sys.executable, *(sys.argv if argv is None else [str(script), *argv])])


def write_results(results: dict, out: Path, table: str) -> None:
    """The results JSON at `out`, then the printed table and where the JSON went."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(table)
    print(f"results written to {out}")
