"""The serving environment's pins, `requirements-serving.txt`: written from pip's own resolution, and checked.

    python scripts/serving_requirements.py write --python python3.11 python3.12   # resolve and write the file
    python scripts/serving_requirements.py check                                  # does it still resolve, as written?
    python scripts/serving_requirements.py pins NAME...                            # `name==version` lines of the file

vLLM 0.34.0 pins `flashinfer-python==0.7.3`, a release PyPI does not have, so pip cannot install `vllm==0.34.0` with
its requirements (nor `dflash_hf[vllm]`). The environment is the resolution of vLLM's own requirements (its `audio`
extra included) without that pin, together with dflash_hf's, under `SERVING_PINS` and `requirements-ci.txt`'s other
pins; every package of it is pinned, and it installs with `pip install --no-deps -e . -r requirements-serving.txt`
(README, "Serve the draft"). vLLM runs without FlashInfer then (`VLLM_USE_FLASHINFER_SAMPLER=0`). Resolutions only
read package metadata (`pip install --dry-run --report`): nothing is downloaded but the metadata files.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib
from packaging.markers import Marker
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements-serving.txt"
CI_PINS = REPO / "requirements-ci.txt"
# The versions the serving environment is built around (docs/SERVING.md, "One environment").
SERVING_PINS = {"vllm": "0.34.0", "torch": "2.14.0", "transformers": "5.22.2"}
VLLM_EXTRAS = ("audio",)  # what vLLM needs for audio targets (av, soundfile, soxr, scipy, mistral-common[audio])
# vLLM requirements left out, and why (each a release the package index lacks)
UNAVAILABLE = {"flashinfer-python": "vLLM 0.34.0 pins flashinfer-python==0.7.3, which PyPI does not have"}
# requirements-ci.txt pins the serving environment cannot keep, and why
NOT_FROM_CI = {"numpy": "mistral-common (vLLM's Mistral tokenizer) requires numpy<2.4 on Python <= 3.12"}
HEADER = """\
# The serving environment: vLLM {vllm} with dflash_hf, torch {torch}, transformers {transformers}; every package pinned
# (Linux x86_64, Python {pythons}; torch's CUDA 13 wheels). Install from the checkout (README, "Serve the draft"):
#   pip install --no-deps -e . -r requirements-serving.txt
# Why --no-deps: {unavailable}, so pip cannot resolve vLLM's own
# requirements; this is their resolution without it (vLLM runs without FlashInfer: VLLM_USE_FLASHINFER_SAMPLER=0).
# Written by `python scripts/serving_requirements.py write`; CI's `serving` stage checks that it resolves as written.
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def report(python: str, args: list[str]) -> list[dict]:
    """The packages `pip install --dry-run` would install with `args`, as its JSON report lists them."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        command = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(out)]
        proc = subprocess.run([*command, *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"pip could not resolve ({python}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())["install"]


def vllm_requirements(python: str) -> list[str]:
    """vLLM's requirements (its `VLLM_EXTRAS` included, other extras not), less `UNAVAILABLE`."""
    (item,) = report(python, ["--no-deps", f"vllm=={SERVING_PINS['vllm']}"])
    out = []
    for line in item["metadata"].get("requires_dist", []):
        req = Requirement(line)
        marker = str(req.marker or "")
        extras = set(re.findall(r'extra == "([^"]+)"', marker))
        if canonical(req.name) in UNAVAILABLE or (extras and not extras & set(VLLM_EXTRAS)):
            continue
        if extras:  # the extra's own condition: the marker names nothing else in vLLM 0.34
            req.marker = None
        out.append(str(req))
    return out


def requirements(python: str) -> list[str]:
    """What the environment holds besides vLLM itself (which pip would resolve with the unavailable pin): vLLM's
    requirements and dflash_hf's (pyproject.toml)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*vllm_requirements(python), *project["dependencies"]]


def ci_constraints() -> list[str]:
    lines = [line.split("#")[0].strip() for line in CI_PINS.read_text().splitlines()]
    keep = []
    for line in filter(None, lines):
        name = canonical(Requirement(line).name)
        if name not in {canonical(n) for n in SERVING_PINS} and name not in NOT_FROM_CI:
            keep.append(line)
    return keep + [f"{name}=={version}" for name, version in SERVING_PINS.items() if name != "vllm"]


def resolve(python: str, constraints: list[str]) -> dict[str, str]:
    """name -> version of the environment resolved by `python`'s pip under `constraints`."""
    with tempfile.TemporaryDirectory() as tmp:
        reqs, cons = Path(tmp) / "requirements.txt", Path(tmp) / "constraints.txt"
        reqs.write_text("\n".join(requirements(python)) + "\n")
        cons.write_text("\n".join(constraints) + "\n")
        items = report(python, ["-r", str(reqs), "-c", str(cons)])
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def python_version(python: str) -> str:
    code = "import sys; print('%d.%d' % sys.version_info[:2])"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def read_lock(path: Path = LOCK) -> dict[str, tuple[str, str]]:
    """name -> (version, marker or "") of the file."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            out[canonical(req.name)] = (str(req.specifier).removeprefix("=="), str(req.marker or ""))
    return out


def applicable(lock: dict[str, tuple[str, str]], version: str) -> dict[str, str]:
    return {n: v for n, (v, m) in lock.items() if not m or Marker(m).evaluate({"python_version": version})}


def write(pythons: list[str]) -> None:
    versions = {python: python_version(python) for python in pythons}
    resolved = {python: resolve(python, ci_constraints()) for python in pythons}
    names = sorted(set().union(*resolved.values()))
    lock = {"vllm": (SERVING_PINS["vllm"], "")}
    for name in names:
        found = {python: r[name] for python, r in resolved.items() if name in r}
        lowest = min(found.values(), key=lambda v: tuple(int(x) for x in re.findall(r"\d+", v)))
        marker = " or ".join(f'python_version == "{versions[p]}"' for p in found) if len(found) < len(pythons) else ""
        lock[name] = (lowest, marker)
    lines = [f"{n}=={v}" + (f" ; {m}" if m else "") for n, (v, m) in sorted(lock.items())]
    pythons_text, unavailable = " and ".join(versions.values()), "; ".join(UNAVAILABLE.values())
    header = HEADER.format(pythons=pythons_text, unavailable=unavailable, **SERVING_PINS)
    LOCK.write_text(header + "\n".join(lines) + "\n")
    for python in pythons:  # a version chosen for one Python must resolve on the others as well
        check(python)


def check(python: str = sys.executable) -> None:
    """The environment resolves under the file's pins to exactly the file's packages for `python`."""
    lock = read_lock()
    pins = applicable(lock, python_version(python))
    if pins.pop("vllm", None) != SERVING_PINS["vllm"]:
        raise SystemExit(f"{LOCK.name} does not pin vllm=={SERVING_PINS['vllm']}")
    resolved = resolve(python, [f"{n}=={v}" for n, v in pins.items()])
    extra, missing = sorted(set(resolved) - set(pins)), sorted(set(pins) - set(resolved))
    if extra or missing:
        raise SystemExit(f"{LOCK.name} is incomplete for {python}: unpinned {extra}, not needed {missing}; rewrite it")
    print(f"{LOCK.name}: vLLM and {len(pins)} packages resolve as pinned (Python {python_version(python)})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="resolve with each --python and write requirements-serving.txt")
    w.add_argument("--python", nargs="+", default=[sys.executable], help="interpreters to resolve for")
    sub.add_parser("check", help="resolve with this interpreter under the file's pins; fail if anything differs")
    p = sub.add_parser("pins", help="print the file's `name==version` lines of the named packages")
    p.add_argument("names", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "write":
        write(args.python)
    elif args.command == "check":
        check()
    else:
        lock = read_lock()
        unknown = [n for n in args.names if canonical(n) not in lock]
        if unknown:
            raise SystemExit(f"{LOCK.name} pins none of {unknown}")
        print("\n".join(f"{n}=={lock[canonical(n)][0]}" for n in args.names))


if __name__ == "__main__":
    main()
