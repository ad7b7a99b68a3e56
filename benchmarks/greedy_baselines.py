"""Speculative decoding beside the greedy decoders a user would run instead.

    python benchmarks/greedy_baselines.py --draft runs/x/draft --target whisper-base/hf \
        --data data/speech/eval.json --num_samples 40 --device cuda --output_json results/greedy_baselines.json

`dflash-eval` compares speculative decoding with the target's plain greedy `generate` (a growing cache, eager). At
batch 1 a small target is launch-bound, and transformers' own answer to that is a static cache, whose decode step
`generate` then compiles on a GPU (`generate(..., cache_implementation="static")`; transformers compiles only on
accelerators, so on the CPU it is the static cache alone). This script times, on the same prompts (as `dflash-eval`
builds them from `--data`), in one process:

- `speculative`: `dflash_hf.generation.evaluation.decode_benchmark` with the package's defaults (draft step and
  target verify as CUDA graphs on a GPU), against plain greedy, outputs compared;
- `static_greedy`: the target's greedy `generate` with a static cache, its new tokens compared with plain greedy's.
  Its warm-up decodes the longest prompt first: the static cache is then sized for it (transformers keeps the
  largest size it has used), so the timed prompts reuse one compiled step instead of recompiling per prompt
  length; the warm-up's seconds (compilation included) are reported apart.

Reported: tokens/s of each, speculative against each greedy, and whether every output is identical. A failure of the
static-cache decode (a model transformers cannot run with a static cache) is recorded as `error`, not raised.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: the checkout's package
    sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "benchmarks"))
from decode_profile_parts.record import git_commit  # noqa: E402

from dflash_hf.export.evaluation_setup import load_evaluation  # noqa: E402
from dflash_hf.generation.evaluation import decode_benchmark, synced_clock  # noqa: E402
from dflash_hf.generation.target_generate import generate_inputs, target_generate_new_tokens  # noqa: E402
from dflash_hf.ops.cpu_threads import configure_cpu_threads  # noqa: E402
from dflash_hf.settings.evaluation import EvalSettings  # noqa: E402

STATIC = {"cache_implementation": "static"}


def static_greedy(ft, prompts: list[dict], max_new_tokens: int) -> dict:
    """Plain and static-cache greedy decoding of every prompt: the static one's tokens/s (after a warm-up on the
    longest prompt) and whether its new tokens equal plain greedy's."""
    device = ft.device
    inputs = [generate_inputs(ft, p) for p in prompts]
    longest = max(range(len(inputs)), key=lambda i: prompts[i]["input_ids"].shape[1])
    out = {"warmup_prompt": longest}
    plain = [target_generate_new_tokens(ft, x, max_new_tokens)[0].tolist() for x in inputs]  # failures raise
    try:
        start = synced_clock(device)
        target_generate_new_tokens(ft, inputs[longest], max_new_tokens, **STATIC)
        out["warmup_seconds"] = synced_clock(device) - start
        seconds, tokens, mismatches = 0.0, 0, []
        for i, x in enumerate(tqdm(inputs, desc="static-cache greedy")):
            start = synced_clock(device)
            new = target_generate_new_tokens(ft, x, max_new_tokens, **STATIC)[0].tolist()
            seconds += synced_clock(device) - start
            tokens += len(new)
            if new != plain[i]:
                mismatches.append(i)
    except Exception as error:  # noqa: BLE001 (recorded: a target transformers cannot decode with a static cache)
        return {**out, "error": f"{type(error).__name__}: {error}"}
    return {
        **out,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "identical_to_greedy": not mismatches,
        "mismatched_prompts": mismatches,
    }


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="draft export directory")
    p.add_argument("--target", required=True, help="the frozen target: a Hub id or a local directory")
    p.add_argument("--data", required=True, help="a NeMo speech manifest, or text prompts as dflash-eval reads them")
    p.add_argument("--family", default=None, help="target family row override")
    p.add_argument("--prompt", default=None, help="default user text of manifest conversations")
    p.add_argument("--num_samples", type=int, default=40)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--output_json", default="greedy_baselines.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.num_samples < 1:
        raise SystemExit(f"--num_samples must be >= 1, got {args.num_samples}")
    configure_cpu_threads()
    eval_args = EvalSettings(
        draft=args.draft,
        target=args.target,
        data=args.data,
        family=args.family,
        prompt=args.prompt,
        num_samples=args.num_samples,
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        precision=args.precision,
        output_json=args.output_json,
    )
    device, ft, draft, prompts, _ = load_evaluation(eval_args)
    prompts = list(prompts)
    if not prompts:
        raise SystemExit(f"--data {args.data!r} gave no prompt")
    with torch.no_grad():
        spec = decode_benchmark(draft, ft, prompts, args.max_new_tokens, progress=True, total=len(prompts)).as_dict()
        static = static_greedy(ft, prompts, args.max_new_tokens)
    results = {
        "what": "speculative decoding (package defaults) against plain greedy generate and static-cache greedy "
        "generate (compiled by transformers on a GPU), the same prompts, batch 1",
        **vars(args),
        "commit": git_commit(),
        "command": " ".join([sys.executable, *sys.argv]),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "speculative": spec,
        "static_greedy": static,
        "speedup_vs_static_greedy": (
            spec["spec_tokens_per_s"] / static["tokens_per_s"] if "tokens_per_s" in static else None
        ),
    }
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(
        f"speculative {spec['spec_tokens_per_s']:.1f} tok/s (tau {spec['tau']:.2f}, identical "
        f"{spec['outputs_identical']}), plain greedy {spec['greedy_tokens_per_s']:.1f} tok/s "
        f"({spec['speedup']:.2f}x), static-cache greedy "
        + (
            f"{static['tokens_per_s']:.1f} tok/s ({results['speedup_vs_static_greedy']:.2f}x; identical "
            f"{static['identical_to_greedy']}; warm-up {static['warmup_seconds']:.1f} s)"
            if "tokens_per_s" in static
            else f"failed: {static['error']}"
        )
    )
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
