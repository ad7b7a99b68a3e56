"""`dflash-eval`: real acceptance length (tau) and tokens/s of speculative decoding against the target's own
greedy decoding (`generate`) on the same prompts; greedy outputs must be identical.

    dflash-eval --draft runs/x/draft --target /models/qwen3-asr --data dev.jsonl --max_new_tokens 128
    dflash-eval --config eval.yaml --num_samples 50

`--data` is a NeMo manifest (or lhotse cuts file): each prompt is the conversation up to the assistant turn,
rendered and processed exactly as in training; or, for text targets, JSON lines of prompts:
`{"prompt": "raw text"}` (tokenized as is) or `{"messages": [...]}` (chat template + generation prompt).

A manifest's conversations take the settings the draft was trained with, recorded in its export (user prompt, system
prompt, cut fields, family row): `--prompt`, `--system_prompt` and `--family` left out take the recorded values; given
ones that differ override them with a warning (tau then measures prompts the draft was not trained on).

The results JSON is written beside the draft, `<draft>/eval_<data name>.json` (`--output_json` elsewhere); an existing
results file is refused before anything loads unless `--overwrite_output_json true`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from transformers import HfArgumentParser

from dflash_hf.cli.config import parse_with_config
from dflash_hf.export.draft_target import check_draft_target
from dflash_hf.export.drafts import resolve_draft_dir
from dflash_hf.export.evaluation_setup import check_evaluation_inputs, load_evaluation
from dflash_hf.export.training_record import read_training_record
from dflash_hf.generation.decode_options import DecodeOptions
from dflash_hf.generation.evaluation import decode_benchmark
from dflash_hf.generation.tree_verify import check_tree_target
from dflash_hf.ops.cpu_threads import configure_cpu_threads
from dflash_hf.settings.evaluation import EvalSettings

DATA_SUFFIXES = (".gz", ".jsonl", ".json")  # stripped from --data's file name for the default results name


def results_path(args: EvalSettings) -> Path:
    """`--output_json`, else `<draft>/eval_<data name>.json` (the data file's name without its suffixes)."""
    if args.output_json:
        return Path(args.output_json)
    name = Path(args.data).name
    for suffix in DATA_SUFFIXES:
        name = name.removesuffix(suffix)
    return Path(args.draft) / f"eval_{name or 'data'}.json"


def check_results_path(args: EvalSettings) -> Path:
    """The results file (`results_path`), checked: not a directory, not written over unless
    `--overwrite_output_json true`, in a writable folder; refused before anything loads, not after the decoding."""
    out = results_path(args)
    if out.is_dir():
        raise IsADirectoryError(f"--output_json {out} is a directory; give a file name (e.g. {out}/eval.json)")
    if out.exists() and not args.overwrite_output_json:
        raise FileExistsError(
            f"--output_json {out} exists (an earlier evaluation's results); pass --overwrite_output_json true to "
            "replace it, or --output_json NEW.json"
        )
    folder = next((p for p in out.absolute().parents if p.exists()), None)
    if folder is not None and not os.access(folder, os.W_OK):
        raise PermissionError(f"--output_json {out}: {folder} is not writable; give --output_json in a folder you own")
    return out


def make_parser() -> HfArgumentParser:
    return HfArgumentParser(EvalSettings)


def evaluate(args: EvalSettings) -> dict:
    """Decode the prompts both ways; returns the results written to `args.output_json`."""
    device, target, draft, prompts, total = load_evaluation(args)
    if args.tree_budget:  # a target that cannot take tree verification: refused before any decoding
        check_tree_target(target)
    cfg = draft.config
    target_check = check_draft_target(  # before any decoding: a draft of another target is refused
        args.draft, cfg, target, allow_mismatch=args.allow_target_mismatch, target_name=args.target
    )
    stats = decode_benchmark(
        draft,
        target,
        prompts,
        args.max_new_tokens,
        progress=True,
        total=total,
        options=DecodeOptions.from_settings(args),
        tree_budgets=args.tree_budget,
    )
    if stats.prompts == 0:
        raise ValueError(f"--data {args.data!r} gave no prompt (no row with an assistant response to cut before)")
    return {
        **stats.as_dict(),
        "per_slot_acceptance": stats.per_slot_acceptance(cfg.block_size),
        "block_size": cfg.block_size,
        "device": str(device),
        "draft_step": _ways(stats.draft_steps),
        "verify_step": _ways(stats.verify_steps),
        "conversation_recorded": read_training_record(resolve_draft_dir(args.draft)).conversation,  # as used
        "target_check": target_check,
        **asdict(args),
    }


def _ways(steps: dict[str, int]) -> str:
    """How a step ran over the prompts (auto falls back to eager where the fixed shape cannot run)."""
    return next(iter(steps)) if len(steps) == 1 else ", ".join(f"{k}: {n} prompts" for k, n in steps.items())


def results_table(results: dict) -> str:
    rows = [
        f"{'decoder':<16} {'tokens':>8} {'tokens/s':>10}",
        f"{'speculative':<16} {results['spec_tokens']:>8} {results['spec_tokens_per_s']:>10.1f}",
        f"{'target greedy':<16} {results['greedy_tokens']:>8} {results['greedy_tokens_per_s']:>10.1f}",
        f"prompts {results['prompts']}, block size {results['block_size']}, draft step {results['draft_step']}, "
        f"verify {results['verify_step']}, tau {results['tau']:.3f} "
        f"(mean acceptance length over {results['cycles']} cycles), speedup {results['speedup']:.2f}x, "
        f"outputs identical: {'yes' if results['outputs_identical'] else 'NO'}",
        "slot k accepted (k = 1..block_size-1): " + " ".join(f"{a:.3f}" for a in results["per_slot_acceptance"]),
    ]
    for budget, tree in results.get("tree", {}).items():  # tree verification beside the chain (`--tree_budget`)
        speed = tree["spec_tokens_per_s"] / results["spec_tokens_per_s"]
        rows.append(
            f"tree {budget:>4}: tau {tree['tau']:.3f} ({tree['tau'] / results['tau']:.2f}x the chain's), "
            f"{tree['spec_tokens_per_s']:.1f} tokens/s ({speed:.2f}x), target forwards {tree['target_forwards']} "
            f"(chain {results['target_forwards']}), outputs identical: {'yes' if tree['outputs_identical'] else 'NO'}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    (args,) = parse_with_config(make_parser(), argv)
    configure_cpu_threads()
    check_evaluation_inputs(args)
    out = check_results_path(args)
    args.output_json = str(out)  # the results record where they were written
    results = evaluate(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(results_table(results))
    print(f"results written to {out}")
    if not results["outputs_identical"] and not args.allow_mismatch:
        print(
            f"speculative output differs from target greedy on prompts {results['mismatched_prompts']}: greedy "
            "speculative decoding must be lossless (pass --allow_mismatch true to accept bf16 noise)"
        )
        return 1
    trees = {
        b: tree["mismatched_prompts"] for b, tree in results.get("tree", {}).items() if not tree["outputs_identical"]
    }
    if trees and not args.allow_mismatch:
        print(
            f"tree-verified output differs from target greedy (prompts per tree budget: {trees}): tree decoding "
            "must be lossless too (pass --allow_mismatch true to accept bf16 noise)"
        )
        return 1
    return 0


if __name__ == "__main__":
    from dflash_hf.cli.console import evaluate

    evaluate()
