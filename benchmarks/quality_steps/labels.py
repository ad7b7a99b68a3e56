"""``labels NAME``: the target's own greedy outputs as training labels (text targets and Whisper)."""

from __future__ import annotations

import fcntl
import json
import subprocess
from pathlib import Path

from .common import cli, read_jsonl, run, sha256_file, stamp_ok, write_json, write_jsonl, write_stamp
from .configs import RunConfig
from .fetch import target_dir, text_mask_id
from .fetch_whisper import whisper_dirs
from .prompts import to_text_cuts


def labels_dir(cache: Path, target: str) -> Path:
    """Where a text target's generated labels and cuts go (SmolLM2's next to the prompts, as before)."""
    prompts = cache / "data" / "prompts"
    return prompts if target == "smollm2" else prompts / target


def generate_labels(cache: Path, cfg: RunConfig, batch_size: int, device: str, dtype: str) -> Path:
    """The text target's own greedy responses to the train prompts (dflash-generate-labels), as lhotse cuts;
    the mask token must never occur in them."""
    from transformers import AutoTokenizer

    prompts = cache / "data" / "prompts" / "train.json"
    if not prompts.is_file():
        raise SystemExit(f"{prompts} missing: run `real_targets.py data prompts` first")
    out = labels_dir(cache, cfg.target) / "train.generated.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    run(
        [
            *cli("dflash_hf.cli.generate_labels"),
            "--model",
            target_dir(cache, cfg.target),
            "--manifest",
            prompts,
            "--output",
            out,
            "--batch_size",
            str(batch_size),
            "--max_new_tokens",
            str(cfg.label_max_new_tokens),
            "--device",
            device,
            "--dtype",
            dtype,
        ]
    )
    rows = read_jsonl(out)
    tok = AutoTokenizer.from_pretrained(target_dir(cache, cfg.target))
    mask = text_mask_id(cache, cfg.target)
    hits = [r["id"] for r in rows if mask in tok(r["text"], add_special_tokens=False)["input_ids"]]
    if hits:
        raise RuntimeError(f"mask token {mask} occurs in generated labels {hits[:5]}; pick another mask token")
    # The last lines (an eighth, at most 16) are the dev set for validation during training, not trained on.
    n_dev = min(16, max(1, len(rows) // 8))
    train, dev = out.with_name("train.labelled.json"), out.with_name("dev.json")
    write_jsonl(train, rows[:-n_dev])
    write_jsonl(dev, rows[-n_dev:])
    to_text_cuts(train, out.with_name("train.cuts.jsonl.gz"))
    to_text_cuts(dev, out.with_name("dev.cuts.jsonl.gz"))
    return out.with_name("train.cuts.jsonl.gz")


def check_whisper_conversion(cache: Path) -> Path:
    """The converted Whisper-base, refused when it predates the tokenizer repair (a model copied from an old cache:
    its tokenizer encodes " the" as two tokens Whisper never writes, see `repair_byte_level_merges`)."""
    hf = target_dir(cache, "whisper-base")
    stamp = hf / "converted.json"
    if not stamp.is_file() or "tokenizer_repairs" not in json.loads(stamp.read_text()):
        raise SystemExit(
            f"{hf} was converted before the tokenizer repair: delete it and run `real_targets.py fetch "
            "whisper-base` again (then re-pack it for the device)"
        )
    return hf


def whisper_label_manifests(cache: Path) -> dict[str, Path]:
    root = cache / "data" / "speech" / "generated"
    return {name: root / f"{name}.json" for name in ("train", "dev")}


def whisper_labels_made_from(cache: Path) -> dict:
    """What a generated set belongs to: these speech manifests and this converted model (a rebuilt speech set or a
    re-converted model makes it anew)."""
    speech = cache / "data" / "speech"
    return {
        "sources": {n: sha256_file(speech / f"{n}.json") for n in whisper_label_manifests(cache)},
        "model": sha256_file(whisper_dirs(cache)[1] / "converted.json"),
    }


def whisper_labels_current(cache: Path, made_from: dict | None = None) -> bool:
    """Whether the generated set exists, unchanged, and was made from `made_from` (default: the current one)."""
    stamp = whisper_label_manifests(cache)["train"].with_name("labels.json")
    made_from = made_from or whisper_labels_made_from(cache)
    return stamp_ok(stamp) and json.loads(stamp.read_text()).get("made_from") == made_from


def generate_whisper_labels(cache: Path, batch_size: int, device: str, dtype: str, shards: int = 1) -> dict[str, Path]:
    """Whisper-base's own greedy transcripts of the speech train and dev clips (``dflash-generate-labels``; ``shards``
    processes at once, each over a contiguous part of a manifest (its ``--num_shards``), joined in the manifest's
    order). One set serves every ``generated_labels`` configuration; a second caller waits for the first (a file lock)
    and reuses it."""
    speech = cache / "data" / "speech"
    if not stamp_ok(speech / "speech.json"):
        raise SystemExit(f"{speech / 'speech.json'} missing: run `real_targets.py data speech` first")
    if shards < 1:
        raise SystemExit(f"--shards must be >= 1, got {shards}")
    check_whisper_conversion(cache)
    from dflash_hf.data.label_rows import shard_of

    out = whisper_label_manifests(cache)
    root = out["train"].parent
    root.mkdir(parents=True, exist_ok=True)
    stamp = root / "labels.json"
    made_from = whisper_labels_made_from(cache)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if whisper_labels_current(cache, made_from):
            return out
        plan = root / ".plan.json"  # parts resume only under the plan that made them (same sources, model, shards)
        if not plan.is_file() or json.loads(plan.read_text()) != {**made_from, "shards": shards}:
            for stale in [*root.glob(".*.part*.json"), *out.values(), stamp]:
                stale.unlink(missing_ok=True)
            write_json(plan, {**made_from, "shards": shards})
        for name, path in out.items():
            lines = [line for line in (speech / f"{name}.json").read_text().splitlines() if line.strip()]
            if not lines:
                raise SystemExit(f"{speech / f'{name}.json'} has no clips")
            ids = [json.loads(line).get("id") for line in lines]
            if path.is_file() and [r["id"] for r in read_jsonl(path)] == ids:
                continue  # this manifest finished in an earlier, interrupted call
            jobs = []
            for k in (k for k in range(shards) if shard_of(lines, shards, k)):  # the CLI's non-empty parts
                part = root / f".{name}.part{k}.json"
                jobs.append(
                    (
                        part,
                        subprocess.Popen(
                            [
                                str(a)
                                for a in [
                                    *cli("dflash_hf.cli.generate_labels"),
                                    "--model",
                                    whisper_dirs(cache)[1],
                                    "--manifest",
                                    speech / f"{name}.json",
                                    "--num_shards",
                                    shards,
                                    "--shard_index",
                                    k,
                                    "--output",
                                    part,
                                    "--batch_size",
                                    batch_size,
                                    "--max_new_tokens",
                                    128,
                                    "--device",
                                    device,
                                    "--dtype",
                                    dtype,
                                ]
                            ]
                        ),
                    )
                )
            failed = [str(part) for part, proc in jobs if proc.wait() != 0]
            if failed:
                raise RuntimeError(f"dflash-generate-labels failed for {failed} (rerun: finished lines are kept)")
            rows = [row for part, _ in jobs for row in read_jsonl(part)]
            if len(rows) != len(lines):
                raise RuntimeError(f"{name}: {len(rows)} generated lines for {len(lines)} clips")
            if [r["id"] for r in rows] != ids:
                raise RuntimeError(f"{name}: the generated lines are not in the manifest's order; delete {root}")
            write_jsonl(path, rows)
            for part, _ in jobs:
                part.unlink()
            changed = sum(r["text"].strip() != r["reference_text"].strip() for r in rows)
            print(f"{name}: {len(rows)} transcripts, {changed} differ from the flite text")
        write_stamp(stamp, list(out.values()), made_from=made_from)
        plan.unlink()
    return out
