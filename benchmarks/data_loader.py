"""What the training data loader costs per batch, epoch by epoch: the sampler alone (it runs in the training
process whatever `--dataloader_num_workers` says: it validates each sample and counts its tokens for the batch
budget) and the whole loader (sampler + collation: chat template, tokenization, audio decoding and features) with
each worker count asked for. Each measurement builds its own loader, as `dflash-train` does.

    python benchmarks/data_loader.py --target $CACHE/smollm2/hf --data train.cuts.jsonl.gz --max-tokens 8192 \\
        --workers 0 2 --epochs 2 --out docs/results/loader_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from dflash_hf.data import build_train_dataloader
from dflash_hf.objective.blocks import doc_ids_from, leading_padding, move_leading_padding, sample_anchors
from dflash_hf.targets.processor import load_processor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile_parts.record import git_commit  # noqa: E402
from quality_steps.common import write_json  # noqa: E402


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--target", required=True, help="the target (its config and processor/tokenizer): a Hub id or a local directory"
    )
    p.add_argument("--data", required=True, nargs="+", help="training data as dflash-train's --train_data takes it")
    p.add_argument("--max-tokens", type=int, default=8192, help="the batch token budget (--max_tokens)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="loader worker counts to time")
    p.add_argument("--epochs", type=int, default=2, help="epochs per measurement (the first one counts tokens)")
    p.add_argument("--max-batches", type=int, default=None, help="batches per epoch at most (default: all)")
    p.add_argument(
        "--num-anchors",
        type=int,
        default=64,
        help="anchors a row for the anchor draw's timing "
        "(the training step's planning draws them on the host for every micro-batch)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    p.add_argument(
        "--features",
        choices=["waves", "compact", "window"],
        default="waves",
        help="Whisper targets: the "
        "padded waves whose features the target computes (dflash-train's loader), compact features (the "
        "frames that hold audio), or the processor's whole 30 s window",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p


def _time_epochs(batches, epochs: int, max_batches: int | None) -> list[dict]:
    """ms per batch, rows per batch and (a loader's) MiB of tensors per batch, what moves between processes and to
    the device, of each epoch of `batches` (a loader or its batch sampler: `set_epoch`, then iterated)."""
    out = []
    for epoch in range(epochs):
        batches.set_epoch(epoch)
        start, n, rows, size = time.perf_counter(), 0, 0, 0
        for batch in batches:
            n += 1
            rows += len(batch) if not isinstance(batch, dict) else batch["input_ids"].shape[0]
            if isinstance(batch, dict):
                size += sum(v.nbytes for v in batch.values() if isinstance(v, torch.Tensor))
            if max_batches is not None and n >= max_batches:
                break
        seconds = time.perf_counter() - start
        out.append(
            {
                "epoch": epoch,
                "batches": n,
                "rows_per_batch": round(rows / max(n, 1), 1),
                "ms_per_batch": round(1000 * seconds / max(n, 1), 2),
                **({"mib_per_batch": round(size / max(n, 1) / 2**20, 2)} if size else {}),
            }
        )
    return out


def _time_anchor_draw(loader, num_anchors: int, max_batches: int) -> dict:
    """ms per batch of `sample_anchors` on the loader's first batches (rows aligned left as the planning does)."""
    batches = list(itertools.islice(iter(loader), max_batches))
    seconds = 0.0
    for i, batch in enumerate(batches):
        shifts = leading_padding(batch["attention_mask"])
        am = move_leading_padding(batch["attention_mask"], shifts)
        loss_mask = move_leading_padding(batch["loss_mask"], shifts) & am.bool()
        doc_ids = doc_ids_from(am, None)
        start = time.perf_counter()
        sample_anchors(loss_mask, doc_ids, num_anchors, generator=torch.Generator().manual_seed(i), pad_multiple=8)
        seconds += time.perf_counter() - start
    return {
        "batches": len(batches),
        "num_anchors": num_anchors,
        "ms_per_batch": round(1000 * seconds / max(len(batches), 1), 3),
    }


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    if args.epochs < 1 or any(w < 0 for w in args.workers):
        raise SystemExit("--epochs must be >= 1 and --workers >= 0")
    torch.set_num_threads(args.threads)
    processor, config = load_processor(args.target), AutoConfig.from_pretrained(args.target)

    def loader(workers: int):
        start = time.perf_counter()
        built = build_train_dataloader(
            args.data,
            processor,
            config,
            max_tokens=args.max_tokens,
            num_workers=workers,
            compact_features=args.features != "window",
            device_features=args.features == "waves",
        )
        return built, round(time.perf_counter() - start, 2)

    sampler_loader, build_s = loader(0)
    rows = {
        "sampler": {
            "build_s": build_s,
            "epochs": _time_epochs(sampler_loader.batch_sampler, args.epochs, args.max_batches),
        }
    }
    for workers in args.workers:
        full, build_s = loader(workers)
        rows[f"loader_workers_{workers}"] = {
            "build_s": build_s,
            "epochs": _time_epochs(full, args.epochs, args.max_batches),
        }
    rows["anchor_draw"] = _time_anchor_draw(loader(0)[0], args.num_anchors, args.max_batches or 50)
    result = {
        "what": "training data loader ms per batch: the sampler alone (training process) and the whole loader",
        "commit": git_commit(),
        "command": " ".join(["benchmarks/data_loader.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "features": args.features,
        "rows": rows,
    }
    for name, row in rows.items():
        if "epochs" not in row:
            print(name, f"{row['ms_per_batch']} ms/batch over {row['batches']} batches")
            continue
        print(
            name,
            f"build {row['build_s']} s;",
            "; ".join(
                f"epoch {e['epoch']}: {e['ms_per_batch']} ms/batch ({e['rows_per_batch']} rows)" for e in row["epochs"]
            ),
        )
    if args.out:
        write_json(Path(args.out), result)
    return result


if __name__ == "__main__":
    main()
