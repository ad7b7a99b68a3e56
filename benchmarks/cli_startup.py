"""How fast the console scripts answer `--help` and an argument error (well under 2 s).

Each case runs in a fresh interpreter, `--repeats` times; the table gives the median wall and CPU (user + sys)
seconds, and whether torch was imported. A measurement, not a test: run it on a quiet machine.

    python benchmarks/cli_startup.py
    python benchmarks/cli_startup.py --repeats 5 --json cli_startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each case: a name and the command-line arguments of `dflash-train` (run through its console entry point).
CASES = {
    "import only": None,
    "--help": ["--help"],
    "argument error (--gamma x)": ["--gamma", "x"],
    "unknown option": ["--no_such_option", "1"],
}
PROBE = """
import sys
from dflash_hf.cli.console import run_command
argv = {argv!r}
code = 0
if argv is not None:
    try:
        code = run_command("dflash-train", argv)
    except SystemExit as e:
        code = e.code
print("torch_loaded=%d exit=%s" % ("torch" in sys.modules, code), file=sys.stderr)
"""


def run_once(argv: list[str] | None) -> tuple[float, float, bool]:
    """(wall s, CPU s, torch imported) of one fresh interpreter running the case."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    status = [line for line in out.stderr.splitlines() if line.startswith("torch_loaded=")]
    if not status:
        raise RuntimeError(f"probe failed for {argv}: {out.stderr[-2000:]}")
    return wall, cpu, status[-1].startswith("torch_loaded=1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="Fresh interpreters per case (median reported).")
    parser.add_argument("--json", default=None, help="Also write the results to this JSON file.")
    args = parser.parse_args()
    results = {}
    print(f"{'case':<30} {'wall s':>8} {'cpu s':>8}  torch")
    for name, argv in CASES.items():
        runs = [run_once(argv) for _ in range(args.repeats)]
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        torch_loaded = any(r[2] for r in runs)
        results[name] = {"wall_s": wall, "cpu_s": cpu, "torch_loaded": torch_loaded, "repeats": args.repeats}
        print(f"{name:<30} {wall:>8.2f} {cpu:>8.2f}  {'yes' if torch_loaded else 'no'}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"load average (1 min) during the run: {load}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cases": results, "load_average_1min": load}, indent=2) + "\n")


if __name__ == "__main__":
    main()
