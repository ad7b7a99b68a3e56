"""One `vllm_parity.py` run: the target check, the vLLM runs per concurrency, dflash_hf's decode, the results."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from decode_profile_parts.record import git_commit
from serving_checks import TOP_LOGPROBS, versions

from dflash_hf.errors import DFlashUserError

from .arguments import ParityArguments
from .comparison import check_target, compare, eos_ids, target_summary
from .engine import engine_pairs, run_engine
from .reference import reference_greedy, run_dflash_hf
from .request_rows import read_requests


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"


def run(args: ParityArguments, command: str, save: Callable[[dict], None]) -> dict:
    """The whole comparison. Per engine pair (`engine.engine_pairs`: one for the default concurrencies), the target
    alone first (the first pair's engine runs the target check before its timed passes; a failed check stops the run
    there, before any engine with the draft, when `--stop_if_target_differs`), then the target with the draft. `save`
    gets the record so far after each engine (marked ``incomplete`` with what is left), so a run cut short leaves what
    it measured."""
    draft_config = json.loads((Path(args.draft) / "config.json").read_text())
    block = int(draft_config.get("block_size", draft_config.get("dflash_config", {}).get("block_size", 0)))
    if block < 2:
        raise DFlashUserError(f"--draft {args.draft}: config.json has no block_size; it is not a draft export")
    read_requests(args.prompts, args.num_prompts)  # bad rows fail before any engine starts
    eos = eos_ids(args.target)
    header = {
        "script": "benchmarks/vllm_parity.py",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": command,
        "gpu": gpu_name(),
        "versions": versions(),
        "args": asdict(args),
        "architecture": (draft_config.get("architectures") or ["?"])[0],
        "num_speculative_tokens": block - 1,
    }
    greedy = reference_greedy(args, eos) if args.target_check else None
    target_check, alone, drafted = None, {}, {}

    def so_far() -> dict:
        return {**header, "target_check": target_check, "runs": runs_record(alone, drafted, args.concurrency)}

    with tempfile.TemporaryDirectory() as tmp:
        for n, (max_num_seqs, served) in enumerate(engine_pairs(args.concurrency).items()):
            check = TOP_LOGPROBS if n == 0 and greedy is not None else 0
            passes = run_engine(args, None, 0, max_num_seqs, served, Path(tmp), check_logprobs=check)
            alone.update({key: result for key, result in passes.items() if key != "target_check"})
            if check:
                target_check = check_target(passes["target_check"], greedy, args.tie_margin, eos)
                print(target_summary(target_check), flush=True)
                if not target_check["passed"] and args.stop_if_target_differs:
                    return {**so_far(), "stopped": "the target alone differs from transformers"}
            save({**so_far(), "incomplete": left(alone, drafted, args.concurrency)})
            drafted.update(run_engine(args, args.draft, block - 1, max_num_seqs, served, Path(tmp)))
            save(
                {
                    **so_far(),
                    "incomplete": left(alone, drafted, args.concurrency) or "dflash_hf's decode and the comparison",
                }
            )
    ours = None if args.skip_dflash_hf else run_dflash_hf(args)
    runs = {c: (alone[c], drafted[c]) for c in args.concurrency}
    throughput = [
        {
            "concurrency": c,
            "tokens_per_s_target_alone": a["output_tokens"] / a["seconds"],
            "tokens_per_s_with_draft": d["output_tokens"] / d["seconds"],
            "speedup": (d["output_tokens"] / d["seconds"]) / (a["output_tokens"] / a["seconds"]),
        }
        for c, (a, d) in runs.items()
    ]
    return {
        **header,
        "target_check": target_check,
        "serving_class": alone[args.concurrency[0]]["serving_class"],
        "parity": compare(alone[args.concurrency[0]], drafted[args.concurrency[0]], ours, eos),
        "throughput": throughput,
        "runs": runs_record(alone, drafted, args.concurrency),
        "dflash_hf": ours,
    }


def runs_record(alone: dict, drafted: dict, concurrency: list[int]) -> dict:
    """The vLLM runs by concurrency, as the results JSON holds them (a run not measured yet left out)."""
    out = {}
    for c in concurrency:
        row = {name: runs[c] for name, runs in (("target_alone", alone), ("with_draft", drafted)) if c in runs}
        if row:
            out[str(c)] = row
    return out


def left(alone: dict, drafted: dict, concurrency: list[int]) -> str:
    """The vLLM runs not measured yet, in words ("" when none is left)."""
    parts = [
        f"{name} at concurrency {', '.join(str(c) for c in concurrency if c not in runs)}"
        for name, runs in (("the target alone", alone), ("the target with the draft", drafted))
        if any(c not in runs for c in concurrency)
    ]
    return f"the vLLM runs of {' and '.join(parts)}" if parts else ""
