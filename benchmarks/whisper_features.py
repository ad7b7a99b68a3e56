"""Whisper log-mel features: `WhisperFeatureExtractor` against
`dflash_hf.targets.families.whisper_features.whisper_log_mel` on the
clips of a NeMo manifest, in the batches the data loader would form (one thread, as one loader worker runs).
Checks the two are bit-identical and writes the timings to a JSON file.

    python benchmarks/whisper_features.py --processor openai/whisper-base \\
        --manifest train.json --num_clips 440 --batch_size 55 --out docs/results/features.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_hf.targets.families.whisper_features import whisper_log_mel  # noqa: E402


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processor", required=True, help="directory of a Whisper processor (its feature extractor)")
    p.add_argument("--manifest", required=True, help="NeMo manifest (audio_filepath relative to it, 16 kHz clips)")
    p.add_argument("--num_clips", type=int, default=440)
    p.add_argument("--batch_size", type=int, default=55)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--bucketed",
        action="store_true",
        help="batch clips of similar duration together, as the loader's duration buckets do",
    )
    p.add_argument("--out", default=None, help="JSON results file")
    return p


def load_clips(manifest: Path, n: int) -> tuple[list[np.ndarray], int]:
    rows = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()][:n]
    clips, rate = [], None
    for r in rows:
        audio, rate = sf.read(manifest.parent / r["audio_filepath"], dtype="float32")
        clips.append(audio)
    return clips, rate


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    from transformers import AutoFeatureExtractor

    torch.set_num_threads(args.threads)
    fe = AutoFeatureExtractor.from_pretrained(args.processor)
    clips, rate = load_clips(Path(args.manifest), args.num_clips)
    if args.bucketed:
        clips.sort(key=len)
    batches = [clips[i : i + args.batch_size] for i in range(0, len(clips), args.batch_size)]
    timings = {"extractor": [], "whisper_log_mel": []}
    for batch in batches:
        start = time.perf_counter()
        ref = fe(batch, sampling_rate=rate, return_tensors="pt")["input_features"]
        timings["extractor"].append(time.perf_counter() - start)
        start = time.perf_counter()
        got = whisper_log_mel(fe, batch, rate)
        timings["whisper_log_mel"].append(time.perf_counter() - start)
        if got is None or not torch.equal(got, ref):
            raise SystemExit("whisper_log_mel differs from the extractor (or declined): not bit-identical")
    seconds = sum(len(c) for c in clips) / rate
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "what": "Whisper log-mel of real clips per loader batch, one thread",
        "commit": commit,
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "command": "python "
        + " ".join(
            [
                Path(__file__).as_posix().split("/")[-2] + "/" + Path(__file__).name,
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "clips": len(clips),
        "audio_seconds": round(seconds, 1),
        "mean_clip_seconds": round(seconds / len(clips), 2),
        "batch_size": args.batch_size,
        "bucketed": args.bucketed,
        "bit_identical": True,
        **{f"{k}_ms_per_clip": round(1000 * sum(v) / len(clips), 2) for k, v in timings.items()},
        **{f"{k}_median_ms_per_batch": round(1000 * statistics.median(v), 1) for k, v in timings.items()},
    }
    result["speedup"] = round(result["extractor_ms_per_clip"] / result["whisper_log_mel_ms_per_clip"], 2)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
