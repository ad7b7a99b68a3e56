"""``pack`` / ``unpack``: a model directory in size-limited, sha256-checked pieces for an offline machine."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from .common import sha256_file, write_json

MAX_PIECE_BYTES = 40 * 1024 * 1024


def pack(model_dir: Path, out_dir: Path, max_bytes: int = MAX_PIECE_BYTES) -> Path:
    """Split every file of ``model_dir`` into pieces of at most ``max_bytes`` and deal them into groups
    (``out_dir/group_NN/``, each at most ``max_bytes``: a bundle for a machine without internet that takes files in
    size-limited transfers).
    ``pieces.json`` (at ``out_dir`` and in the last group) lists each piece with its sha256 and group, and the
    sha256 of each whole file."""
    shutil.rmtree(out_dir, ignore_errors=True)
    staging = out_dir / "staging"
    staging.mkdir(parents=True)
    index: dict = {"max_bytes": max_bytes, "files": {}}
    pieces = []
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
        entries = []
        with open(path, "rb") as f:
            while block := f.read(max_bytes):
                piece = staging / f"{path.name}.{len(entries):03d}"
                piece.write_bytes(block)
                entries.append({"name": piece.name, "sha256": hashlib.sha256(block).hexdigest()})
                pieces.append((piece, entries[-1]))
        index["files"][path.name] = {"sha256": sha256_file(path), "pieces": entries}
    groups: list[int] = []  # bytes per group; first fit, largest pieces first
    for piece, entry in sorted(pieces, key=lambda pe: -pe[0].stat().st_size):
        size = piece.stat().st_size
        slot = next((g for g, used in enumerate(groups) if used + size <= max_bytes), None)
        if slot is None:
            slot = len(groups)
            groups.append(0)
        groups[slot] += size
        entry["group"] = f"group_{slot:02d}"
        (out_dir / entry["group"]).mkdir(exist_ok=True)
        piece.replace(out_dir / entry["group"] / piece.name)
    staging.rmdir()
    write_json(out_dir / "pieces.json", index)
    shutil.copy(out_dir / "pieces.json", out_dir / f"group_{len(groups) - 1:02d}" / "pieces.json")
    return out_dir / "pieces.json"


def unpack(pieces_dir: Path, model_dir: Path) -> Path:
    """Reassemble ``pack``'s pieces found anywhere under ``pieces_dir`` (groups may be copied in one by one);
    every piece and every file is checked against its sha256."""
    found = {p.name: p for p in pieces_dir.rglob("*") if p.is_file()}
    if "pieces.json" not in found:
        raise FileNotFoundError(f"no pieces.json under {pieces_dir}; copy the last group there")
    index = json.loads(found["pieces.json"].read_text())
    missing = [pc["name"] for e in index["files"].values() for pc in e["pieces"] if pc["name"] not in found]
    if missing:
        raise FileNotFoundError(f"pieces missing under {pieces_dir}: {missing}; copy their groups there")
    model_dir.mkdir(parents=True, exist_ok=True)
    for name, entry in index["files"].items():
        target = model_dir / name
        if target.is_file() and sha256_file(target) == entry["sha256"]:
            continue
        tmp = target.with_suffix(target.suffix + ".tmp")
        with open(tmp, "wb") as out:
            for piece in entry["pieces"]:
                data = found[piece["name"]].read_bytes()
                if hashlib.sha256(data).hexdigest() != piece["sha256"]:
                    raise RuntimeError(f"piece {piece['name']} is corrupt (sha256 mismatch); copy it again")
                out.write(data)
        tmp.replace(target)
        if sha256_file(target) != entry["sha256"]:
            raise RuntimeError(f"{target}: sha256 mismatch after reassembly")
    return model_dir
