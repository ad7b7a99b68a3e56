"""Where `float8_draft_linears` pays: each draft projection of a training-benchmark shape, bf16 against FP8.

For every linear layer of one draft decoder layer (q, k, v, o, gate, up, down) and the context projection `fc`, with
the rows a training step of the shape feeds it (block tokens `Q = batch * anchors * block`, context tokens
`S = batch * seq_len`: k and v see `S + Q` rows, `fc` sees `S` rows and needs no input gradient), this times a
forward + backward of three variants, each compiled as `torch_compile_layers: [draft]` compiles a layer:

- `bf16`: `nn.Linear` in the training precision;
- `fp8`: :class:`dflash_hf.ops.float8.Float8Linear` as training runs it (quantization included);
- `fp8_matmuls`: the same three matmuls on operands quantized beforehand (what FP8 would cost with free quantization).

Each variant is timed twice: its wall time per call (CUDA events, synchronized after each call: for the small
projections mostly the host's launch time) and, on a GPU, its kernel time per call (`torch.profiler`: what it costs in
a training step that keeps the GPU busy, the figure to read). `fp8 - fp8_matmuls` is what quantizing costs;
`bf16 - fp8` what the layer saves. The per-layer sums times the draft's
layers (plus `fc` once) give what FP8 can save on the shape's draft side, to set beside `train_step.py`'s rows.

    python benchmarks/float8_linears.py --shape qwen3-1.7b qwen3-8b qwen3-1.7b-speechlike \
        --out float8_linears.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step_parts.shapes import SHAPES  # noqa: E402
from train_step_parts.timing import device_busy_us, matmul_tflops, time_ms  # noqa: E402

from dflash_hf.models.configuration_dflash import DFlashConfig  # noqa: E402
from dflash_hf.ops.float8 import Float8Linear, forward_operands, input_grad_operands, scaled_mm  # noqa: E402

VARIANTS = ("bf16", "fp8", "fp8_matmuls")


def projections(shape: dict, draft_layers: int, block_size: int) -> list[dict]:
    """The draft's linear layers for a Qwen3-dimensioned text shape: name, rows, in and out features, whether the
    input needs a gradient, and how many of it a step runs."""
    if shape.get("kind", "qwen3") != "qwen3":
        raise SystemExit("--shape: a Qwen3-dimensioned text shape (qwen3-1.7b, qwen3-8b, qwen3-1.7b-speechlike, tiny)")
    dims = {k: v for k, v in shape.items() if k not in ("seq_len", "num_anchors", "batch_size")}
    cfg = DFlashConfig.from_target_config(
        Qwen3Config(**dims), mask_token_id=0, num_hidden_layers=draft_layers, block_size=block_size
    )
    batch = shape.get("batch_size", 1)
    q_rows, s_rows = batch * shape["num_anchors"] * block_size, batch * shape["seq_len"]
    h, i = cfg.hidden_size, cfg.intermediate_size
    attn, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = [
        ("q_proj", q_rows, h, attn),
        ("k_proj", s_rows + q_rows, h, kv),
        ("v_proj", s_rows + q_rows, h, kv),
        ("o_proj", q_rows, attn, h),
        ("gate_proj", q_rows, h, i),
        ("up_proj", q_rows, h, i),
        ("down_proj", q_rows, i, h),
    ]
    rows = [
        dict(name=n, rows=m, in_features=k, out_features=o, input_grad=True, count=draft_layers)
        for n, m, k, o in per_layer
    ]
    rows.append(dict(name="fc", rows=s_rows, in_features=cfg.num_taps * h, out_features=h, input_grad=False, count=1))
    return rows


def _matmuls_only(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, input_grad: bool):
    """A callable running `Float8Linear`'s three matmuls on operands quantized beforehand (not in the timed call);
    it returns the output and the weight and input gradients."""
    forward, backward = forward_operands(x, weight), input_grad_operands(grad, weight)

    def run():
        grad_x = scaled_mm(*backward, x.dtype) if input_grad else None
        return scaled_mm(*forward, x.dtype), grad.t() @ x, grad_x

    return run


def _module_step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    """A callable running `layer`'s forward + backward (compiled or not); it returns the output and the weight and
    input gradients."""

    def run():
        layer.weight.grad = None
        if x.requires_grad:
            x.grad = None
        out = layer(x)
        out.backward(grad)
        return out, layer.weight.grad, x.grad

    return run


def variant_steps(proj: dict, device: torch.device, dtype: torch.dtype, compile_layers: bool, seed: int = 0) -> dict:
    """The three variants' forward + backward callables for one projection, on the same data."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    m, k, n = proj["rows"], proj["in_features"], proj["out_features"]
    x = torch.randn(m, k, generator=g).to(device, dtype).requires_grad_(proj["input_grad"])
    grad = torch.randn(m, n, generator=g).to(device, dtype)
    bf16 = nn.Linear(k, n, bias=False, device=device, dtype=dtype)
    fp8 = copy.deepcopy(bf16)
    fp8.__class__ = Float8Linear
    steps = {}
    for name, layer in (("bf16", bf16), ("fp8", fp8)):
        layer.train()
        if compile_layers:
            layer.compile()
        steps[name] = _module_step(layer, x, grad)
    matmuls = _matmuls_only(x.detach(), bf16.weight.detach(), grad, proj["input_grad"])
    steps["fp8_matmuls"] = torch.compile(matmuls) if compile_layers else matmuls
    return steps


def kernel_ms(fn, steps: int) -> float:
    """Milliseconds of GPU kernels per call of `fn` (`torch.profiler` over `steps` calls): the call's cost inside a
    training step that keeps the GPU busy, without the host's launch time, which a projection timed alone shows."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return device_busy_us(prof.key_averages()) / 1e3 / steps


def measure(shape_name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """Every projection of the shape: the variants' median wall ms (CUDA events) and, on a GPU, their kernel ms; and
    what FP8 saves by each."""
    rows, keys = [], ["ms"] + (["kernel_ms"] if device.type == "cuda" else [])
    for proj in projections(SHAPES[shape_name], args.draft_layers, args.block_size):
        torch._dynamo.reset()
        steps = variant_steps(proj, device, dtype, not args.eager)
        got = {"ms": {v: statistics.median(time_ms(steps[v], device, args.warmup, args.steps)) for v in VARIANTS}}
        if device.type == "cuda":
            got["kernel_ms"] = {v: kernel_ms(steps[v], args.steps) for v in VARIANTS}
        row = dict(proj)
        for key in keys:
            t = got[key]
            row |= {f"{v}_{key}": round(t[v], 4) for v in VARIANTS}
            row |= {
                f"saved_{key}": round(t["bf16"] - t["fp8"], 4),
                f"quantize_{key}": round(t["fp8"] - t["fp8_matmuls"], 4),
            }
        rows.append(row)
        t = got[keys[-1]]
        print(
            f"{shape_name:24s} {proj['name']:9s} {proj['rows']:6d} x {proj['in_features']:5d} -> "
            f"{proj['out_features']:5d}  {keys[-1]}: bf16 {t['bf16']:8.3f}  fp8 {t['fp8']:8.3f}  "
            f"matmuls {t['fp8_matmuls']:8.3f}",
            flush=True,
        )
    total = {
        f"{name}_{key}": round(sum(r[f"{name}_{key}"] * r["count"] for r in rows), 3)
        for key in keys
        for name in (*VARIANTS, "saved", "quantize")
    }
    return {"shape": shape_name, "projections": rows, "draft_side_total": total}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shape",
        nargs="+",
        default=["qwen3-1.7b", "qwen3-8b", "qwen3-1.7b-speechlike"],
        choices=[n for n, s in SHAPES.items() if s.get("kind", "qwen3") == "qwen3"],
    )
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--eager", action="store_true", help="do not compile (the CPU check; GPU training compiles)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    p.add_argument("--out", required=True, help="results JSON")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "compiled": not args.eager,
        "steps": args.steps,
        "bf16_matmul_tflops": round(matmul_tflops(256 if device.type == "cpu" else 8192, dtype, device), 1),
        "shapes": [measure(name, args, device, dtype) for name in args.shape],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
