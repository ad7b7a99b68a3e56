"""Training-step benchmark of DFlash drafts at realistic shapes (random weights), through the product path.

Every timed step is `DFlashObjective.loss` + `normalize` -> `backward` -> gradient clipping -> AdamW step, what
`Trainer.train` runs per micro-batch. Two rates: the median of steps timed one by one (CUDA events, the device
drained after each), and the pipelined mean of back-to-back steps with one synchronization at the end. Two modes:

- `draft`: the draft side alone. The target's forward is replaced by fixed random taps (`FixedTapsTarget`),
  labels are the data tokens; blocks, mask, draft forward/backward, chunked lm_head + CE and AdamW are timed.
- `full`: the whole step, the frozen target's forward with tap hooks and `target_argmax` labels included.

Anchors are drawn on the CPU by `DFlashObjective.plan` before the step (the trainer does it in
`get_batch_samples`, before any forward); that CPU time is reported separately as `plan_ms` (median of 5).

FLOP counting (model FLOPs, what the math needs; recomputation is not counted):

- draft layers on the block tokens `Q = b*N*B`: q/k/v/o projections and the SwiGLU MLP, `2*m*n*k` per matmul;
- context tokens `S`: `fc` (`n_taps*H -> H`) once, K/V projections of every layer;
- attention: `4 * d * heads` per visible (query, key) pair (QK^T and PV), pairs counted from the mask;
- trained matmuls x3 (forward, input grad, weight grad); `fc` x2 (its input, the taps, needs no grad);
  attention x3 (forward, and dQ/dK + dV/dP in backward);
- frozen lm_head on the valid slots x2 (forward + input grad);
- `full` adds the target forward (x1): projections, MLP and causal attention of every layer, and the
  `target_argmax` label projection of the supervised positions.

MFU = model FLOP/s over the bf16 matmul rate measured in the same run (an `n^3` matmul, median of timed runs).

    python benchmarks/train_step.py --shape qwen3-8b --out results.json
    python benchmarks/train_step.py --tiny --out tiny.json   # CPU regression run

The parts live in `benchmarks/train_step_parts/` (shapes, models, batches, timing, FLOPs, the trainer loop, one
case); this script parses the command line, runs the cases (each in its own process on CUDA) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if str(Path(__file__).resolve().parent) not in sys.path:  # imported from elsewhere (tests): the parts' package
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_step_parts.case import run_case, traceback_tail  # noqa: E402
from train_step_parts.models import build_target  # noqa: E402
from train_step_parts.shapes import CPU_CONFIGS, GPU_CONFIGS, SHAPES  # noqa: E402
from train_step_parts.timing import matmul_tflops  # noqa: E402


def run_isolated(args: argparse.Namespace, name: str, mode: str, spec: str) -> dict:
    """One case in a fresh Python process, so that compiled state (dynamo caches and recompile counts) cannot leak
    from one case into the next. Its MFU is against the matmul ceiling measured in that process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        argv = [
            "--shape",
            name,
            "--modes",
            mode,
            "--configs" if mode == "draft" else "--full-configs",
            spec,
            "--no-isolate",
            "--out",
            str(out),
            "--block-size",
            str(args.block_size),
            "--draft-layers",
            str(args.draft_layers),
            "--warmup",
            str(args.warmup),
            "--steps",
            str(args.steps),
        ]
        optional = {
            "--seq-len": args.seq_len,
            "--num-anchors": args.num_anchors,
            "--batch-size": args.batch_size,
            "--dtype": args.dtype,
            "--matmul-size": args.matmul_size,
            "--profile": args.profile,
        }
        argv += [x for flag, value in optional.items() if value is not None for x in (flag, str(value))]
        argv += ["--trainer-loop"] if args.trainer_loop else []
        argv += ["--compile-target"] if args.compile_target else []
        argv += ["--target-cuda-graph", args.target_cuda_graph]
        done = subprocess.run([sys.executable, __file__, *argv], check=False)
        rows = json.loads(out.read_text())["results"] if out.exists() else []
    if rows:
        return rows[0]
    return {"shape": name, "mode": mode, "config": spec, "error": f"case process exited {done.returncode}"}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shape",
        nargs="+",
        default=None,
        choices=sorted(SHAPES),
        help="default: qwen3-1.7b qwen3-8b (with --tiny: tiny); the tiny-* shapes are CPU-sized versions "
        "of smollm2-135m, whisper-base and qwen3-asr-1.7b(-packed)",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="CPU regression run: fp32, sdpa configs, the tiny shape unless --shape names tiny-* shapes.",
    )
    p.add_argument("--modes", nargs="+", default=["draft", "full"], choices=["draft", "full"])
    p.add_argument("--configs", nargs="+", default=None, help="e.g. attn=flex,ce=2048,ckpt=0,compile=none")
    p.add_argument("--full-configs", nargs="+", default=None, help="configs for mode full (default: the first)")
    p.add_argument("--seq-len", type=int, default=None, help="default: per shape (1024 for 1.7B, 3072 for 8B)")
    p.add_argument("--num-anchors", type=int, default=None, help="default: per shape (256 for 1.7B, 512 for 8B)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows of the text shapes, utterances of whisper-base (default: per shape, 1 for qwen3)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--matmul-size", type=int, default=None, help="n of the n^3 ceiling matmul (8192 on CUDA)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    p.add_argument(
        "--trainer-loop",
        action="store_true",
        help="also time Trainer.train() on the same batch (CUDA: and list where its steps synchronize)",
    )
    p.add_argument(
        "--no-isolate",
        action="store_true",
        help="CUDA: run every case in this process (default: "
        "one fresh process per case, so compiled state of one case cannot affect the next)",
    )
    p.add_argument("--profile", default=None, help="CUDA: write a torch.profiler operator table per case here")
    p.add_argument(
        "--compile-target",
        "--compile_target",
        dest="compile_target",
        action="store_true",
        help="torch_compile_layers [target]: torch.compile the frozen target's decoder layers (CUDA; mode full)",
    )
    p.add_argument(
        "--target-cuda-graph",
        default="auto",
        choices=["auto", "on", "off"],
        help="target_cuda_graph (mode full): auto = the product default (a graph on a GPU where the target "
        "can be captured), on = always, off = the eager target forward",
    )
    return p


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.shape is None:
        args.shape = ["tiny"] if args.tiny else ["qwen3-1.7b", "qwen3-8b"]
    elif args.tiny and not all(name.startswith("tiny") for name in args.shape):
        raise ValueError(f"--tiny runs on the CPU: --shape must name tiny shapes, got {args.shape}")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    configs = args.configs or list(GPU_CONFIGS if device.type == "cuda" else CPU_CONFIGS)
    full_configs = args.full_configs or configs[:1]
    n = args.matmul_size or (8192 if device.type == "cuda" else 256)
    ceiling = matmul_tflops(n, dtype, device)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "matmul_size": n,
        "matmul_tflops": round(ceiling, 4),
        "results": [],
    }
    print(f"matmul {n}^3 {report['dtype']}: {ceiling:.1f} TFLOP/s", flush=True)
    isolate = device.type == "cuda" and not args.no_isolate
    for name in args.shape:
        shape = SHAPES[name]
        tmodel = None if isolate else build_target(shape, dtype, device)
        for mode in args.modes:
            for spec in configs if mode == "draft" else full_configs:
                if isolate:
                    row = run_isolated(args, name, mode, spec)
                else:
                    try:
                        row = run_case(name, shape, tmodel, mode, spec, args, device, dtype, ceiling)
                    except Exception as exc:  # one failing variant (e.g. a compile error) must not lose the others
                        row = {
                            "shape": name,
                            "mode": mode,
                            "config": spec,
                            "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback_tail(exc),
                        }
                report["results"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "flops"}), flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(report, indent=1))
        del tmodel
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        f"\n{'shape':<11} {'mode':<5} {'config':<36} {'ms':>8} {'TFLOP/s':>8} {'MFU':>6} {'pipe ms':>8} "
        f"{'MFU':>6} {'peak GiB':>8}"
    )
    for r in report["results"]:
        if "error" in r:
            print(f"{r['shape']:<11} {r['mode']:<5} {r['config']:<36} ERROR {r['error'][:80]}")
        else:
            print(
                f"{r['shape']:<11} {r['mode']:<5} {r['config']:<36} {r['ms_per_step']:>8.2f} {r['tflops']:>8.1f} "
                f"{r['mfu']:>6.1%} {r['ms_pipelined']:>8.2f} {r['mfu_pipelined']:>6.1%} {r['peak_gib']:>8.2f}"
            )
    return report


if __name__ == "__main__":
    main()
