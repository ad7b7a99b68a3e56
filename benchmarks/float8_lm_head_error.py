"""How far FP8 moves a real lm_head's logits and CE gradient (issue 16, `float8_lm_head`).

    python benchmarks/float8_lm_head_error.py --target $CACHE/smollm2/hf \
        --sentences $CACHE/data/corpus/sentences.jsonl --out docs/results/float8_lm_head_error_smollm2_cpu.json

The target's final hidden states over corpus text (bf16, teacher-forced, the next token as the label) are projected
by its lm_head four ways against float32 math: logits in bf16 and in FP8 (e4m3 per row of hidden and of the lm_head:
what an FP8 forward would give), and the CE's input gradient `(softmax - onehot) @ W` as the fused CE computes it
from the bf16 logits, in bf16 and with `float8_lm_head` (the package's own kernel and quantized lm_head). Reported:
logit error (max, RMS, against the logits' standard deviation), argmax agreement and per-token CE change; gradient
relative error and per-row cosine (mean, minimum).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from decode_profile import git_commit  # noqa: E402
from real_targets import read_jsonl, write_json  # noqa: E402

from dflash_hf.ops.float8 import frozen_weight_for_input_grad, quantize  # noqa: E402
from dflash_hf.ops.fused_ce import _ce_and_logit_grad  # noqa: E402


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="a text target's HF directory")
    p.add_argument("--sentences", required=True, help="JSON lines with a 'text' field (the corpus' sentences.jsonl)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of joined sentences to project")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True, help="results JSON")
    return p


def logit_stats(got: torch.Tensor, exact: torch.Tensor, labels: torch.Tensor) -> dict:
    ce, ce_exact = (F.cross_entropy(x, labels, reduction="none") for x in (got, exact))
    return {
        "max_abs_logit_error": (got - exact).abs().max().item(),
        "rms_logit_error": (got - exact).pow(2).mean().sqrt().item(),
        "argmax_agreement": (got.argmax(-1) == exact.argmax(-1)).float().mean().item(),
        "mean_ce": ce.mean().item(),
        "max_abs_ce_change": (ce - ce_exact).abs().max().item(),
    }


def grad_stats(got: torch.Tensor, exact: torch.Tensor) -> dict:
    cos = F.cosine_similarity(got, exact, dim=-1)
    return {
        "relative_error": ((got - exact).norm() / exact.norm()).item(),
        "mean_cosine": cos.mean().item(),
        "min_cosine": cos.min().item(),
    }


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16).eval()
    text = " ".join(r["text"] for r in read_jsonl(Path(args.sentences)) if r.get("text", "").strip())
    ids = tok(text[: args.tokens * 20], return_tensors="pt").input_ids[:, : args.tokens + 1]
    if ids.shape[1] <= args.tokens:
        raise SystemExit(f"{args.sentences} gives {ids.shape[1]} tokens; --tokens {args.tokens} needs more")
    with torch.no_grad():
        hidden = model.model(ids[:, :-1]).last_hidden_state[0]  # [T, H], final-normed
    weight, labels = model.lm_head.weight.detach(), ids[0, 1:]
    exact = hidden.float() @ weight.float().t()
    hq, h_scale = quantize(hidden, -1)
    wq, w_scale = quantize(weight, -1)
    fp8_logits = torch._scaled_mm(hq, wq.t(), scale_a=h_scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16)
    logits = {
        "bf16": logit_stats((hidden @ weight.t()).float(), exact, labels),
        "fp8_forward": logit_stats(fp8_logits.float(), exact, labels),
    }

    delta = torch.softmax(exact, -1) - F.one_hot(labels, weight.shape[0])
    grad_exact = delta @ weight.float()
    ones, bf16_logits = torch.ones(len(labels)), hidden @ weight.t()  # the fused CE's two paths, as it runs them
    _, _, g16, _ = _ce_and_logit_grad(bf16_logits, labels, ones, need_grad=True, fp8=False)
    _, _, g8, g8_scale = _ce_and_logit_grad(bf16_logits, labels, ones, need_grad=True, fp8=True)
    w8, w8_scale = frozen_weight_for_input_grad(weight)
    grad_fp8 = torch._scaled_mm(g8, w8, scale_a=g8_scale, scale_b=w8_scale, out_dtype=torch.bfloat16).float()
    grads = {"bf16": grad_stats((g16 @ weight).float(), grad_exact), "float8_lm_head": grad_stats(grad_fp8, grad_exact)}
    result = {
        "what": "FP8 against bf16 on a real lm_head: logits and the CE input gradient, float32 reference",
        "commit": git_commit(),
        "target": args.target,
        "tokens": len(labels),
        "vocab": weight.shape[0],
        "hidden": weight.shape[1],
        "logit_std": exact.std().item(),
        "logits": logits,
        "ce_input_gradient": grads,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    write_json(Path(args.out), result)
    print(json.dumps({"logits": logits, "ce_input_gradient": grads}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
