"""Time to the first training step and peak resident memory of `dflash-train` on synthetic NeMo manifests of growing
size: what the data pre-flight costs (every row checked before training; docs/PERFORMANCE.md, "Manifest pre-flight").

Each manifest has `rows` lines pointing at a few short wav files (plausible text for their duration). Each size runs
`dflash-train --max_steps 1` in a fresh process, stopped at its first training step: the wall time from the process
start to that step (the fastest of `--repeats` runs), the CPU seconds of the process and of the processes it
started and waited for (the pre-flight's readers; less sensitive to a busy machine than the wall time), and the peak
resident set of the training process and of the largest process it started. A tiny Qwen3-ASR target is built when
`--target` is not given (the figure is the data's, not the model's). A measurement, not a test: run it on a quiet
machine.

    python benchmarks/manifest_preflight.py --rows 1000 200000 2000000 --out preflight.json
    python benchmarks/manifest_preflight.py --target /models/qwen3-asr --mask_token_id 151669 --rows 2000000
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "runs", "far", "away")
CHILD = """
import json, os, resource, sys, time
started = float(sys.argv[1])
from dflash_hf.training.trainer import DFlashTrainer

def first_step(self, *args, **kwargs):
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    found = {
        "first_step_s": time.time() - started,
        "cpu_s": own.ru_utime + own.ru_stime,
        "children_cpu_s": children.ru_utime + children.ru_stime,
        "rss_kib": own.ru_maxrss,
        "children_rss_kib": children.ru_maxrss,
    }
    with open(sys.argv[2], "w") as f:
        json.dump(found, f)
    os._exit(0)

DFlashTrainer.training_step = first_step
from dflash_hf.cli.train import main
main(sys.argv[3:])
"""


def write_audio(root: Path, count: int = 8) -> list[tuple[str, float]]:
    """`count` short wav files (0.8 to 2.2 s of low noise): (relative path, duration)."""
    import numpy as np
    import soundfile as sf

    (root / "audio").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    files = []
    for i in range(count):
        duration = 0.8 + 0.2 * i
        path = f"audio/a{i}.wav"
        sf.write(root / path, (0.01 * rng.standard_normal(int(16000 * duration))).astype("float32"), 16000)
        files.append((path, duration))
    return files


def write_manifest(path: Path, rows: int, files: list[tuple[str, float]]) -> None:
    """`rows` NeMo lines (kept when a file of that many lines is there already)."""
    marker = path.with_suffix(".rows")
    if path.is_file() and marker.is_file() and marker.read_text() == str(rows):
        return
    with open(path, "w") as f:
        for i in range(rows):
            audio, duration = files[i % len(files)]
            words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(int(2.5 * duration)))
            f.write(f'{{"audio_filepath": "{audio}", "duration": {duration}, "text": "{words} {i}"}}\n')
    marker.write_text(str(rows))


def run_once(manifest: Path, target: str, mask_token_id: int, work: Path, extra: list[str]) -> dict:
    """One `dflash-train` process, stopped at its first step: its times and memory."""
    out = work / "first_step.json"
    out.unlink(missing_ok=True)
    argv = [
        "--target_name_or_path", target, "--train_data", str(manifest), "--mask_token_id", str(mask_token_id),
        "--output_dir", str(work / "run"), "--overwrite_output_dir", "true", "--max_steps", "1", "--block_size", "4",
        "--num_anchors", "8", "--max_tokens", "2000", "--prompt", "Transcribe.", "--label_source", "ground_truth",
        "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(started), str(out), *argv], env=env, capture_output=True, text=True
    )
    if not out.is_file():
        raise RuntimeError(f"dflash-train did not reach its first step (exit {proc.returncode}): {proc.stderr[-3000:]}")
    found = json.loads(out.read_text())
    return {
        "time_to_first_step_s": round(found["first_step_s"], 2),
        "cpu_s": round(found["cpu_s"], 2),
        "children_cpu_s": round(found["children_cpu_s"], 2),
        "peak_rss_gb": round(found["rss_kib"] / 2**20, 3),
        "peak_rss_largest_child_gb": round(found["children_rss_kib"] / 2**20, 3),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "usable_cores": cores, "load_average_1min": round(os.getloadavg()[0], 2), "python": sys.version}


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1000, 200_000, 2_000_000], help="manifest sizes")
    parser.add_argument("--target", help="target directory or Hub id (default: a tiny random Qwen3-ASR target)")
    parser.add_argument("--mask_token_id", type=int, default=262, help="the draft's mask token (262: the tiny target)")
    default_work = Path(os.environ.get("DFLASH_BENCH_CACHE", Path.home() / ".cache" / "dflash_hf_bench"))
    parser.add_argument(
        "--work_dir",
        default=str(default_work / "manifest_preflight"),
        help="manifests (1.7 GB for 20M rows), audio and run directories; default under $DFLASH_BENCH_CACHE",
    )
    parser.add_argument("--skip_bad_samples", action="store_true", help="train with --skip_bad_samples true")
    parser.add_argument("--repeats", type=int, default=1, help="runs per size (the table takes the fastest)")
    parser.add_argument("--out", help="write the results JSON here")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    target = args.target
    if target is None:
        from dflash_hf.testing import tiny

        target = str(work / "target")
        if not (work / "target" / "config.json").is_file():
            tiny.save_tiny_target(target, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)
    files = write_audio(work)
    extra = ["--skip_bad_samples", "true"] if args.skip_bad_samples else []
    rows = []
    for count in args.rows:
        manifest = work / f"manifest_{count}.jsonl"
        write_manifest(manifest, count, files)
        runs = [run_once(manifest, target, args.mask_token_id, work, extra) for _ in range(args.repeats)]
        fastest = min(runs, key=lambda r: r["time_to_first_step_s"])
        result = {"rows": count, "manifest_mb": round(manifest.stat().st_size / 2**20, 1), **fastest, "runs": runs}
        print(json.dumps(result), flush=True)
        rows.append(result)
    results = {
        "command": ["python", "benchmarks/manifest_preflight.py", *argv],
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "machine": machine(),
        "target": args.target or "tiny random Qwen3-ASR (dflash_hf.testing.tiny)",
        "skip_bad_samples": args.skip_bad_samples,
        "results": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
