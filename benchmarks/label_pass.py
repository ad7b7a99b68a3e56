"""The `target_argmax` label pass by chunk size (issue 16): `FrozenTarget.argmax_labels` on a training shape's
supervised positions, each `target_argmax_chunk_size` timed, and how many labels differ from the default's.

    python benchmarks/label_pass.py --device cuda --out results/label_pass.json
    python benchmarks/label_pass.py --device cpu --shape tiny        # the same code on a small shape

The pass projects the supervised positions' final states through the frozen lm_head `chunk` rows at a time and
takes each row's argmax; its matmul is `[chunk, H] x [H, V]`, so a small chunk runs a short matmul many times (the
speech-like 1.7B shape: 14,336 positions, 112 chunks of 128 at the default). Random bf16 weights and states of the
shape (the labels' agreement across chunk sizes depends on near-ties, which real states have fewer of). The lm_head
is a plain `nn.Linear`; the method runs as the trainer calls it, on a stand-in holding only what it reads.
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: the checkout's package
    sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "benchmarks"))
from decode_profile import command_line, device_name, git_commit, write_results  # noqa: E402

from dflash_hf.targets.frozen import FrozenTarget  # noqa: E402

# (vocabulary, hidden size, rows, sequence length): the speech-like 1.7B row of scripts/benchmark_train.py
SHAPES = {"speechlike": (151936, 2048, 64, 256), "qwen3-8b": (151936, 4096, 1, 3072), "tiny": (4096, 64, 4, 64)}
DEFAULT_CHUNK = 128  # `target_argmax_chunk_size`'s default (dflash_hf/training/argument_groups.py)


def measure(shape: str, chunks: list[int], device: torch.device, reps: int) -> dict:
    vocab, hidden, rows, seq = SHAPES[shape]
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(hidden, vocab, bias=False).to(device, torch.bfloat16)
    torch.nn.init.normal_(lm_head.weight, std=0.02)
    stand_in = types.SimpleNamespace(label_logits=lm_head)  # no suppressed ids (a Qwen-family target)
    final = (torch.randn(rows, seq, hidden, device=device) * 2).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (rows, seq), device=device)
    loss_mask = torch.ones(rows, seq, dtype=torch.long)
    loss_mask[:, : seq // 8] = 0  # the first eighth of each row is prompt, as in the training benchmark
    doc_ids = torch.zeros(rows, seq, dtype=torch.long)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(chunk: int) -> tuple[torch.Tensor, float]:
        with torch.no_grad():
            out = FrozenTarget.argmax_labels(stand_in, final, ids, loss_mask, doc_ids, chunk)  # warm-up
            sync()
            start = time.perf_counter()
            for _ in range(reps):
                FrozenTarget.argmax_labels(stand_in, final, ids, loss_mask, doc_ids, chunk)
            sync()
        return out, (time.perf_counter() - start) / reps * 1e3

    reference, _ = run(DEFAULT_CHUNK)
    results = []
    for chunk in chunks:
        labels, ms = run(chunk)
        results.append({"chunk": chunk, "ms": round(ms, 3), "labels_differing": int((labels != reference).sum())})
    positions = int(loss_mask[:, 1:].sum())
    return {
        "shape": shape,
        "vocab": vocab,
        "hidden": hidden,
        "rows": rows,
        "seq": seq,
        "positions": positions,
        "results": results,
    }


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["speechlike", "qwen3-8b"])
    p.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=5, help="timed passes per chunk size (after one warm-up pass)")
    p.add_argument("--out", type=Path, help="JSON file for the results")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    if any(c <= 0 for c in args.chunks):
        raise SystemExit(f"--chunks must be positive, got {args.chunks}")
    device = torch.device(args.device)
    report = {
        "what": "target_argmax label pass by chunk size",
        "commit": git_commit(),
        "command": command_line(Path(__file__), argv),
        "device": device_name(device),
        "torch": torch.__version__,
        "shapes": [measure(s, args.chunks, device, args.reps) for s in args.shape],
    }
    table = "\n".join(
        f"{s['shape']} chunk {r['chunk']:>5}: {r['ms']:8.2f} ms, {r['labels_differing']} labels differ "
        f"from chunk {DEFAULT_CHUNK}'s"
        for s in report["shapes"]
        for r in s["results"]
    )
    if args.out:
        write_results(report, args.out, table)
    else:
        print(table)
    return report


if __name__ == "__main__":
    main()
