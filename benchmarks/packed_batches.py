"""Packed (THD) vs padded (BSHD) training throughput on a duration-skewed synthetic speech set.

Builds a tiny random Qwen3-ASR target in-process, synthesizes many short and a few long utterances, then runs
one epoch of DFlash training steps (target forward with taps, target_argmax labels, draft forward/backward,
AdamW step) through `build_train_dataloader` with the same token budget in three modes: padded with lhotse
duration buckets, padded without buckets, and packed. Reports real (non-padding) tokens per second and the
padding fraction of the batch tensors.

    python benchmarks/packed_batches.py                       # CPU defaults (docs/PACKING.md)
    python benchmarks/packed_batches.py --device cuda --hidden-size 1024 --num-layers 8 --max-tokens 16384 \\
        --num-short 2000 --num-long 400 --long-dur 10 30
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from dflash_hf import DFlashTrainer, DFlashTrainingArguments
from dflash_hf.data import DataSource, build_train_dataloader
from dflash_hf.testing import tiny


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=4, help="target decoder layers")
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--num-anchors", type=int, default=32, help="per row (padded) / per document (packed)")
    p.add_argument("--max-tokens", type=int, default=1024, help="token budget of one batch / packed row")
    p.add_argument("--num-short", type=int, default=48)
    p.add_argument("--num-long", type=int, default=8)
    p.add_argument("--short-dur", type=float, nargs=2, default=(0.6, 2.0), metavar=("MIN", "MAX"))
    p.add_argument("--long-dur", type=float, nargs=2, default=(8.0, 14.0), metavar=("MIN", "MAX"))
    p.add_argument("--warmup-steps", type=int, default=2, help="first steps of each mode, not timed")
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="epochs per mode, modes interleaved; the fastest is kept (robust to other load on the machine)",
    )
    p.add_argument(
        "--attn-implementation",
        default="sdpa",
        help="target attention (packing: sdpa, flex_attention, flash_attention_2, ...)",
    )
    p.add_argument("--attention-backend", default="auto", help="draft attention: auto, sdpa or flex")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: CPU time measures the work, free of thread spin-waits on a shared machine)",
    )
    p.add_argument("--data-dir", default=None, help="where to write the synthetic audio (default: a temp dir)")
    p.add_argument("--json-out", default=None, help="also write the results as JSON here")
    return p


def synthesize(data_dir: Path, args) -> list[DataSource]:
    short = tiny.synthesize_speech(
        data_dir / "short", args.num_short, seed=0, min_dur=args.short_dur[0], max_dur=args.short_dur[1]
    )
    long = tiny.synthesize_speech(
        data_dir / "long", args.num_long, seed=1, min_dur=args.long_dur[0], max_dur=args.long_dur[1]
    )
    return [DataSource(path=str(short), weight=args.num_short), DataSource(path=str(long), weight=args.num_long)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


MODES = {  # name: (packing, num_buckets)
    "padded_bucketed": (False, 10),
    "padded_unbucketed": (False, 1),
    "packed": (True, 10),
}


def run_mode(packing: bool, num_buckets: int, sources, model, processor, args, out_dir: Path) -> dict:
    """One epoch of training steps; returns token counts and timings (warmup steps excluded)."""
    mask_id = processor.tokenizer.convert_tokens_to_ids(tiny.MASK_TOKEN)
    targs = DFlashTrainingArguments(
        output_dir=str(out_dir),
        mask_token_id=mask_id,
        block_size=args.block_size,
        num_draft_layers=args.draft_layers,
        num_anchors=args.num_anchors,
        attention_backend=args.attention_backend,
        precision=args.precision,
        packing=packing,
        packing_max_tokens=args.max_tokens if packing else None,
        use_cpu=args.device == "cpu",
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    torch.manual_seed(0)
    trainer = DFlashTrainer(args=targs, target=model)
    draft = trainer.model.train()
    device = next(draft.parameters()).device
    optim = torch.optim.AdamW(draft.parameters(), lr=6e-4)
    loader = build_train_dataloader(
        sources,
        processor,
        model.config,
        max_tokens=args.max_tokens,
        packing=packing,
        num_buckets=num_buckets,
        shuffle=True,
        seed=0,
    )
    stats = dict(
        steps=0, docs=0, real_tokens=0, slots=0, blocks=0, block_rows=0, step_s=0.0, step_cpu_s=0.0, data_s=0.0
    )
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        t1, c1 = time.perf_counter(), time.process_time()
        plan = trainer.objective.plan(trainer.target, batch, seed=stats["steps"])  # on the host batch, as the trainer
        batch = trainer._prepare_inputs(batch)
        loss = trainer.compute_loss(draft, dict(batch), plan=plan)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        _sync(device)
        t2, c2 = time.perf_counter(), time.process_time()
        timed = stats["steps"] >= args.warmup_steps
        stats["steps"] += 1
        if not timed:
            continue
        am = batch["attention_mask"]
        stats["docs"] += len(batch["cu_seqlens"]) - 1 if packing else am.shape[0]
        stats["real_tokens"] += int(am.sum())
        stats["slots"] += am.numel()
        stats["blocks"] += int(plan.anchors.ge(0).sum())
        stats["block_rows"] += plan.anchors.numel()  # blocks the draft computes, unused (-1) anchors included
        stats["data_s"] += t1 - t0
        stats["step_s"] += t2 - t1
        stats["step_cpu_s"] += c2 - c1
    if stats["real_tokens"] == 0:
        raise ValueError(
            f"no timed steps: the epoch has {stats['steps']} steps, fewer than --warmup-steps + 1; "
            "add utterances or lower --max-tokens"
        )
    stats["padding_fraction"] = 1.0 - stats["real_tokens"] / stats["slots"]
    stats["unused_block_fraction"] = 1.0 - stats["blocks"] / stats["block_rows"]
    stats["tokens_per_s_step"] = stats["real_tokens"] / stats["step_s"]
    stats["tokens_per_cpu_s_step"] = stats["real_tokens"] / stats["step_cpu_s"]  # robust to other load (CPU runs)
    stats["tokens_per_s_total"] = stats["real_tokens"] / (stats["step_s"] + stats["data_s"])
    return stats


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    if args.max_tokens <= 0 or args.repeats < 1:
        raise SystemExit(f"--max-tokens and --repeats must be > 0, got {args.max_tokens}, {args.repeats}")
    torch.set_num_threads(args.threads)
    model, processor = tiny.build_qwen3_asr_target(
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
    )
    model.set_attn_implementation(args.attn_implementation)
    model.to(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(args.data_dir or tmp)
        sources = synthesize(data_dir, args)
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for rep in range(args.repeats):
            for mode in MODES:
                runs[mode].append(run_mode(*MODES[mode], sources, model, processor, args, Path(tmp) / f"{mode}{rep}"))
        key = "tokens_per_cpu_s_step" if args.device == "cpu" else "tokens_per_s_step"
        results = {mode: max(r, key=lambda x: x[key]) for mode, r in runs.items()}
    metric = "tokens_per_cpu_s_step" if args.device == "cpu" else "tokens_per_s_step"
    speedup = {m: results["packed"][metric] / results[m][metric] for m in MODES}
    columns = {
        "steps": "{}",
        "docs": "{}",
        "real_tokens": "{}",
        "padding_fraction": "{:.3f}",
        "blocks": "{}",
        "unused_block_fraction": "{:.3f}",
        "tokens_per_s_step": "{:.0f}",
        "tokens_per_s_total": "{:.0f}",
        "tokens_per_cpu_s_step": "{:.0f}",
    }
    print("| mode | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for mode, s in results.items():
        print(f"| {mode} | " + " | ".join(fmt.format(s[k]) for k, fmt in columns.items()) + " |")
    print(f"packed {metric} relative to: " + ", ".join(f"{m} {v:.2f}x" for m, v in speedup.items()))
    results["packed_speedup_step"] = speedup
    results["all_runs"] = runs
    results["config"] = vars(args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
