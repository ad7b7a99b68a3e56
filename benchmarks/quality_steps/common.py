"""Paths and helpers every step shares: the cache, JSON files, sha256 stamps, subprocesses, pip download."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "docs" / "results"
FIGURES_DIR = REPO / "docs" / "figures"
SAMPLING_RATE = 16000


def default_cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_BENCH_CACHE", Path.home() / ".cache" / "dflash_hf_bench"))


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def stamp_ok(stamp: Path) -> bool:
    """True when ``stamp`` (a json ``{"files": {relpath: sha256}}``) exists and every file still matches."""
    if not stamp.is_file():
        return False
    files = json.loads(stamp.read_text())["files"]
    return all((stamp.parent / rel).is_file() and sha256_file(stamp.parent / rel) == h for rel, h in files.items())


def write_stamp(stamp: Path, files: list[Path], **extra) -> None:
    write_json(stamp, {"files": {str(p.relative_to(stamp.parent)): sha256_file(p) for p in files}, **extra})


def record_or_verify_sha(files: list[Path], record: Path) -> dict[str, str]:
    """First call records the sha256 of each file in ``record``; later calls must match it."""
    digests = {p.name: sha256_file(p) for p in files}
    if record.is_file():
        expected = json.loads(record.read_text())
        bad = [n for n, h in digests.items() if expected.get(n) != h]
        if bad:
            raise RuntimeError(
                f"sha256 mismatch for {bad} against {record}: the download changed or is corrupt; "
                f"delete {record.parent} to fetch again"
            )
    else:
        write_json(record, digests)
    return digests


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def cli(module: str) -> list[str]:
    """Command line running the command ``module.main`` with the current interpreter (console scripts need not be
    installed); its exit status is the command's."""
    return [sys.executable, "-c", f"import sys; from {module} import main; sys.exit(main(sys.argv[1:]))"]


def pip_download(requirements: list[str], dest: Path, sdist: bool = False) -> list[Path]:
    """``pip download --no-deps`` each requirement into ``dest`` (skipped when its file is already there): its wheel,
    or with `sdist` its source archive (``--no-binary :all:``)."""
    dest.mkdir(parents=True, exist_ok=True)
    files = []
    for req in tqdm(requirements, desc="pip download", unit="package", disable=len(requirements) < 2):
        name, version = req.split("==")
        stems = {name.replace("-", "_"), name, name.lower().replace("-", "_")}
        patterns = [f"{stem}-{version}.tar.gz" if sdist else f"{stem}-{version}-*.whl" for stem in sorted(stems)]
        found = sorted(f for pattern in patterns for f in dest.glob(pattern))
        if not found:
            binary = ["--no-binary", ":all:"] if sdist else []
            run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *binary, "-d", dest, req])
            found = sorted(f for pattern in patterns for f in dest.glob(pattern))
        if not found:
            raise RuntimeError(f"pip download {req} produced no file matching {patterns} in {dest}")
        files.append(found[0])
    return files


def tqdm(*args, **kw):
    from tqdm.auto import tqdm as _tqdm

    return _tqdm(*args, **kw)
