"""`dflash-generate-labels` with and without prefetching the next batch (audio read and features made in a background
thread while the target decodes the current batch). Runs the two alternately on the same manifest, checks that they
write the same lines, and writes clips/s to a JSON file.

    python benchmarks/label_generation.py --out docs/results/generate_labels_prefetch_cpu.json
    python benchmarks/label_generation.py --model openai/whisper-base --manifest dev.json \\
        --device cuda --batch_size 64 --out ...

Without `--model` a tiny random Whisper is built (DESIGN section 6: nothing is downloaded); without `--manifest`,
`--num_clips` synthetic utterances (5-15 s; shorter than its window for the tiny Whisper) are written to a temporary
folder.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_hf.cli.generate_labels import generate_labels  # noqa: E402
from dflash_hf.data.label_manifest import check_label_inputs  # noqa: E402
from dflash_hf.settings.labels import LabelSettings  # noqa: E402
from dflash_hf.testing import tiny  # noqa: E402


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="the target: a Hub id or a local directory (default: a tiny random Whisper)"
    )
    p.add_argument("--manifest", default=None, help="NeMo manifest (default: --num_clips synthetic utterances)")
    p.add_argument("--num_clips", type=int, default=96)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed passes of each mode, alternating")
    p.add_argument("--threads", type=int, default=1, help="torch threads (set deliberately on a shared machine)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None, help="JSON results file")
    return p


def _run(model: str, manifest: Path, output: Path, prefetch: bool, args) -> float:
    """Seconds of one `dflash-generate-labels` pass (the target's load included), as the command runs it."""
    output.unlink(missing_ok=True)
    settings = LabelSettings(
        model=model,
        manifest=str(manifest),
        output=str(output),
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        dtype=args.dtype,
        prefetch=prefetch,
    )
    label_target = check_label_inputs(settings)  # the target's config, read once
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    generate_labels(settings, label_target)
    return time.perf_counter() - start


def _clip_durations(model: str | None) -> dict[str, float]:
    """Synthetic clip lengths: 5-15 s for a real Whisper (30 s windows), within the tiny Whisper's shorter window."""
    if model:
        return {"min_dur": 5.0, "max_dur": 15.0}
    return {"min_dur": 1.0, "max_dur": tiny.WHISPER_CHUNK_SECONDS - 0.5}


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.num_clips < 1 or args.repeats < 1 or args.threads < 1:
        raise SystemExit("--num_clips, --repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = args.model or str(tiny.save_tiny_target(tmp / "target", "whisper", hidden_size=64, num_heads=2, seed=0))
        manifest = (
            Path(args.manifest)
            if args.manifest
            else tiny.synthesize_speech(tmp / "speech", args.num_clips, seed=0, **_clip_durations(args.model))
        )
        clips = sum(1 for line in manifest.read_text().splitlines() if line.strip())
        _run(model, manifest, tmp / "warmup.json", True, args)  # model load and first-call costs out of the timings
        seconds: dict[str, list[float]] = {"off": [], "on": []}
        reference = (tmp / "warmup.json").read_text()
        for repeat in range(args.repeats):
            for mode in ("off", "on") if repeat % 2 == 0 else ("on", "off"):  # neither mode always runs first
                seconds[mode].append(_run(model, manifest, tmp / f"{mode}.json", mode == "on", args))
                if (tmp / f"{mode}.json").read_text() != reference:
                    raise SystemExit(f"prefetch {mode}: the written labels differ from the first pass's")
    best = {mode: min(s) for mode, s in seconds.items()}
    result = {
        "what": "dflash-generate-labels over one manifest, the next batch prefetched in a thread (on) or not (off); "
        "seconds per pass include the model load; `threads` are torch's intra-op threads, the prefetch "
        "thread comes on top",
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        ).stdout.strip(),
        "command": " ".join(["python", *sys.argv]),
        "machine": platform.processor() or platform.machine(),
        "device": args.device,
        "threads": args.threads,
        "torch": torch.__version__,
        "model": args.model or "tiny random Whisper (hidden 64)",
        "clips": clips,
        "batch_size": args.batch_size,
        "seconds": seconds,
        "clips_per_s_best": {m: round(clips / s, 2) for m, s in best.items()},
        "speedup_best": round(best["off"] / best["on"], 3),
        "outputs_identical": True,
    }
    print(json.dumps({k: result[k] for k in ("clips", "seconds", "clips_per_s_best", "speedup_best")}))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
