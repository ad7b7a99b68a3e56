"""Whisper's log-mel on the device (issue 16): what `torch.stft`'s plan per batch shape costs, and whether widths
rounded up to a multiple of some frames would give the same features with fewer plans.

    python benchmarks/whisper_log_mel.py --device cuda --out results/whisper_log_mel.json
    python benchmarks/whisper_log_mel.py --device cpu --batches 4     # the same code on the CPU

On a CUDA device the trainer's Whisper loaders hand on padded clips (`input_audio_waves`) and the step computes their
log-mel (`dflash_hf.targets.families.whisper_features.log_mel_of_waves`). A batch's width follows its longest clip,
and lhotse's batch
sizes vary, so nearly every batch is a shape cuFFT has not planned yet. This script makes `--batches` batches of
random rows (24-63) of random noise clips (2 s up to a random 5-20 s), then times the log-mel of all of them with
cuFFT's plan cache cleared (every shape planned anew) and again with the plans cached, for the exact widths and for
widths rounded up to `--round-frames` frames (zeros appended: the frames past a clip's end are padding either way).
It reports ms a batch, the plans made, and whether the rounded widths' features equal the exact ones on the frames
both compute (and the padding frames' value)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: the checkout's package
    sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "benchmarks"))
from decode_profile import command_line, device_name, git_commit, write_results  # noqa: E402

from dflash_hf.targets.families.whisper_features import _filters_on, log_mel_of_waves, padded_waves, standard_extractor  # noqa: E402

MELS, FRAMES = 80, 3000  # Whisper-base's extractor


def make_waves(batches: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    fe = standard_extractor(MELS, FRAMES)
    rng = np.random.default_rng(seed)
    waves = []
    for _ in range(batches):
        rows, longest = int(rng.integers(24, 64)), rng.uniform(5, 20)
        clips = [
            rng.standard_normal(int(s * fe.sampling_rate)).astype(np.float32) * 0.1
            for s in rng.uniform(2, longest, rows)
        ]
        waves.append(torch.from_numpy(padded_waves(fe, clips, fe.sampling_rate)).to(device))
    return waves


def rounded(wave: torch.Tensor, step: int) -> torch.Tensor:
    """`wave` with zeros appended so that it computes a multiple of `step` frames (`padded_waves`' width rule)."""
    fe = standard_extractor(MELS, FRAMES)
    hop, edge = fe.hop_length, fe.n_fft // 2 + fe.hop_length
    frames = -(-((wave.shape[-1] - edge) // hop + 1) // step) * step
    return F.pad(wave, (0, (frames - 1) * hop + edge - wave.shape[-1]))


def timed(waves: list[torch.Tensor], device: torch.device) -> float:
    fe, filters = standard_extractor(MELS, FRAMES), _filters_on(MELS, FRAMES, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for wave in waves:
        log_mel_of_waves(fe, wave, filters)
    sync()
    return (time.perf_counter() - start) / len(waves) * 1e3


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--round-frames", type=int, default=16, help="frames the rounded widths are a multiple of")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="JSON file for the results")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    if args.batches <= 0 or args.round_frames <= 0:
        raise SystemExit("--batches and --round-frames must be positive")
    device = torch.device(args.device)
    exact = make_waves(args.batches, device, args.seed)
    cases = {"exact": exact, f"rounded_{args.round_frames}": [rounded(w, args.round_frames) for w in exact]}
    cache = torch.backends.cuda.cufft_plan_cache[device.index or 0] if device.type == "cuda" else None
    timed(exact[:1], device)  # warm-up: kernels, the mel filters' copy
    report = {
        "what": "Whisper log-mel on the device: cuFFT plans cold and cached, exact and rounded widths",
        "commit": git_commit(),
        "command": command_line(Path(__file__), argv),
        "device": device_name(device),
        "torch": torch.__version__,
        "batches": args.batches,
        "cases": {},
    }
    for name, waves in cases.items():
        if cache is not None:
            cache.clear()
        cold = timed(waves, device)
        plans = cache.size if cache is not None else None
        row = {
            "widths": len({w.shape[-1] for w in waves}),
            "ms_new_plans": round(cold, 3),
            "ms_cached": round(min(timed(waves, device) for _ in range(2)), 3),
            "plans": plans,
        }
        report["cases"][name] = row
    fe = standard_extractor(MELS, FRAMES)
    a, b = (log_mel_of_waves(fe, cases[k][0], _filters_on(MELS, FRAMES, device)) for k in cases)
    kept = a.shape[-1]
    checks = {
        "rounded_equal_on_kept_frames": bool(torch.equal(a, b[..., :kept])),
        "rounded_padding_frames_equal": bool((b[..., kept - 1 :] == a[..., -1:]).all()),
    }
    report.update(checks)
    table = "\n".join(f"{name}: {value}" for name, value in {**report["cases"], **checks}.items())
    if args.out:
        write_results(report, args.out, table)
    else:
        print(table)
    return report


if __name__ == "__main__":
    main()
