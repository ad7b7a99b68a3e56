"""The name of a `decode_profile.py` run and its printed table."""

from __future__ import annotations

from pathlib import Path

from .arguments import ProfileArguments
from .instrument import PHASES


def run_name(args: ProfileArguments) -> str:
    mode = "" if args.draft_cuda_graph == "auto" else f"-graph-{args.draft_cuda_graph}"
    mode += "" if args.verify_cuda_graph == "auto" else f"-verify-{args.verify_cuda_graph}"
    if args.tiny:
        return f"tiny-{args.tiny}{mode}"
    draft = Path(args.draft).resolve()
    return (draft.parent.name if draft.name == "draft" else draft.name) + mode


def results_table(results: dict) -> str:
    prof, wall = results["instrumented"], results["wall_clock"]
    lines = [f"{'phase':<12} {'ms/cycle':>10} {'share':>8}"]
    for name in PHASES:
        lines.append(f"{name:<12} {prof['ms_per_cycle'][name]:>10.3f} {100 * prof['fraction'][name]:>7.1f}%")
    for name, ms in prof["host_parts_ms_per_cycle"].items():
        lines.append(f"  {name:<10} {ms:>10.3f}")
    lines += [
        f"instrumented: {prof['tokens']} tokens in {prof['cycles']} cycles, {prof['total_s']:.3f} s, "
        f"{prof['tokens_per_s']:.1f} tokens/s",
        f"wall clock: speculative {wall['spec_tokens_per_s']:.1f} tokens/s, target greedy "
        f"{wall['greedy_tokens_per_s']:.1f} tokens/s, speedup {wall['speedup']:.2f}x, tau {wall['tau']:.3f}",
        f"outputs identical (speculative, instrumented, greedy): {'yes' if results['outputs_identical'] else 'NO'}",
        f"{results['name']} on {results['device']}, {results['precision']}, block {results['block_size']}, "
        f"commit {results['commit']}",
    ]
    return "\n".join(lines)
