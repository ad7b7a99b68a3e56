"""One `vllm_parity.py` run: the target check, the vLLM runs per concurrency, dflash_hf's decode, the results."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from decode_profile_parts.record import git_commit
from serving_checks import versions

from dflash_hf.errors import DFlashUserError

from .arguments import ParityArguments
from .comparison import check_target, compare, eos_ids, target_summary
from .engine import run_vllm
from .reference import reference_greedy, run_dflash_hf
from .request_rows import read_requests


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"


def run(args: ParityArguments, command: str, save: Callable[[dict], None] = lambda record: None) -> dict:
    """The whole comparison; `save` gets the record so far after the target check and after each concurrency's
    engines (marked ``incomplete`` with what is left), so a run cut short leaves what it measured."""
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
    with tempfile.TemporaryDirectory() as tmp:
        target_check = check_target(args, greedy, Path(tmp), eos) if greedy is not None else None
        if target_check is not None:
            print(target_summary(target_check), flush=True)
            if not target_check["passed"] and args.stop_if_target_differs:
                return {**header, "target_check": target_check, "stopped": "the target alone differs from transformers"}
        runs = {}
        for c in args.concurrency:
            save(
                {
                    **header,
                    "target_check": target_check,
                    "runs": runs_record(runs),
                    "incomplete": f"the vLLM runs from concurrency {c} on",
                }
            )
            runs[c] = (run_vllm(args, None, c, 0, Path(tmp)), run_vllm(args, args.draft, c, block - 1, Path(tmp)))
    save(
        {
            **header,
            "target_check": target_check,
            "runs": runs_record(runs),
            "incomplete": "dflash_hf's decode and the comparison",
        }
    )
    ours = None if args.skip_dflash_hf else run_dflash_hf(args)
    alone, drafted = runs[args.concurrency[0]]
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
        "serving_class": alone["serving_class"],
        "parity": compare(alone, drafted, ours, eos),
        "throughput": throughput,
        "runs": runs_record(runs),
        "dflash_hf": ours,
    }


def runs_record(runs: dict) -> dict:
    """The vLLM runs by concurrency, as the results JSON holds them."""
    return {str(c): {"target_alone": a, "with_draft": d} for c, (a, d) in runs.items()}
