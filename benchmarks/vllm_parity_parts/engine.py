"""vLLM in `vllm_parity.py`: one engine per worker process (the script run with `--worker`), and its launch."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from serving_checks import serving_class, top_logprobs, vllm_environment

from .arguments import DTYPES, ParityArguments
from .request_rows import read_requests, vllm_prompts

SCRIPT_PATH = Path(__file__).resolve().parents[1] / "vllm_parity.py"


def run_worker(config_file: str) -> None:
    """One vLLM engine: the requests decoded greedily, per-request tokens and spec-decode metrics (or top
    log-probabilities), wall time, and the class vLLM resolved for the target."""
    environment = vllm_environment()
    from vllm import LLM, SamplingParams

    config = json.loads(Path(config_file).read_text())
    rows = read_requests(config["prompts"], config["num_prompts"])
    engine = dict(
        model=config["target"],
        dtype=config["dtype"],
        enforce_eager=config["enforce_eager"],
        gpu_memory_utilization=config["gpu_memory_utilization"],
        max_model_len=config["max_model_len"],
        max_num_seqs=config["concurrency"],
        disable_log_stats=False,
        seed=0,
    )
    if config["draft"]:
        engine["speculative_config"] = {
            "method": "dflash",
            "model": config["draft"],
            "num_speculative_tokens": config["num_speculative_tokens"],
        }
        engine["per_request_spec_decode_metrics"] = "detailed"
    llm = LLM(**engine)
    params = SamplingParams(
        temperature=0.0, max_tokens=config["max_new_tokens"], logprobs=config.get("logprobs") or None
    )
    prompts = vllm_prompts(rows, config["target"])
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    counters_before = spec_counters(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    counters = {k: v - counters_before.get(k, 0) for k, v in spec_counters(llm).items()}
    requests = []
    for out in outputs:
        completion = out.outputs[0]
        metrics = completion.spec_decode_metrics
        accepted = list(metrics.per_step_accepted) if metrics is not None else None
        requests.append(
            {"token_ids": list(completion.token_ids), "acceptance_lengths": [a + 1 for a in accepted or []] or None}
        )
        if config.get("logprobs"):
            requests[-1]["top_logprobs"] = top_logprobs(completion)
    result = {
        "seconds": seconds,
        "output_tokens": sum(len(r["token_ids"]) for r in requests),
        "requests": requests,
        "spec_counters": counters,
        "serving_class": serving_class(llm),
        "environment": environment,
    }
    Path(config["result"]).write_text(json.dumps(result))


def spec_counters(llm) -> dict[str, int]:
    """vLLM's speculative-decoding counters (drafts, drafted and accepted tokens) so far."""
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    out = dict.fromkeys(names.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += int(metric.value)
    return out


def run_vllm(
    args: ParityArguments, draft: str | None, concurrency: int, num_spec: int, workdir: Path, logprobs: int = 0
) -> dict:
    tag = "target_check" if logprobs else f"{'draft' if draft else 'alone'}_c{concurrency}"
    config = {
        **{k: getattr(args, k) for k in ("target", "prompts", "num_prompts", "max_new_tokens", "enforce_eager")},
        **{k: getattr(args, k) for k in ("gpu_memory_utilization", "max_model_len")},
        "dtype": DTYPES[args.precision],
        "draft": draft,
        "num_speculative_tokens": num_spec,
        "concurrency": concurrency,
        "logprobs": logprobs,
        "result": str(workdir / f"{tag}.json"),
    }
    config_file = workdir / f"{tag}.config.json"
    config_file.write_text(json.dumps(config))
    paths = ["--target", args.target, "--draft", args.draft, "--prompts", args.prompts]
    code = launch([sys.executable, str(SCRIPT_PATH), *paths, "--worker", str(config_file)])
    if code != 0:
        raise RuntimeError(f"the vLLM run {tag} failed (exit {code}); its output is above")
    return json.loads(Path(config["result"]).read_text())


def launch(command: list[str]) -> int:
    """Run one worker process to its end; its exit status."""
    return subprocess.run(command, check=False).returncode
