"""vLLM in `vllm_parity.py`: the engines a row starts, one per worker process (the script run with `--worker`), each
running a list of passes over the same requests, and their launch.

An engine of `max_num_seqs` = max(`--concurrency`) serves two concurrencies exactly: the largest (every request in one
`generate` call, `max_num_seqs` capping those in flight) and 1 (one request per `generate` call, so one in flight, as
an engine of `max_num_seqs` = 1 would). Any other concurrency gets an engine pair of its own. Each pass starts as a
fresh engine would: the prefix, multimodal and encoder caches emptied, then one warm-up request."""

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


def engine_pairs(concurrency: list[int]) -> dict[int, list[int]]:
    """Each engine pair's `max_num_seqs` -> the concurrencies its passes serve; the pair serving the first
    concurrency (the parity runs and the target check) comes first."""
    largest = max(concurrency)
    pairs: dict[int, list[int]] = {}
    for c in concurrency:
        pairs.setdefault(largest if c in (1, largest) else c, []).append(c)
    return pairs


def run_worker(config_file: str) -> None:
    """One vLLM engine and its passes: per pass the requests decoded greedily, per-request tokens and spec-decode
    metrics (or top log-probabilities), wall time, and the class vLLM resolved for the target."""
    environment = vllm_environment()
    from vllm import LLM, SamplingParams

    config = json.loads(Path(config_file).read_text())
    rows = read_requests(config["prompts"], config["num_prompts"])
    llm = LLM(**engine_arguments(config))
    served_by = serving_class(llm)  # the engine's, the same for each of its passes
    prompts = vllm_prompts(rows, config["target"])
    for served in config["passes"]:
        params = SamplingParams(
            temperature=0.0, max_tokens=config["max_new_tokens"], logprobs=served["logprobs"] or None
        )
        result, completions = timed_pass(llm, prompts, params, served["one_at_a_time"])
        if served["logprobs"]:
            for request, completion in zip(result["requests"], completions):
                request["top_logprobs"] = top_logprobs(completion)
        result.update(
            serving_class=served_by,
            environment=environment,
            engine={"max_num_seqs": config["max_num_seqs"], "one_request_at_a_time": served["one_at_a_time"]},
        )
        Path(served["result"]).write_text(json.dumps(result))


def engine_arguments(config: dict) -> dict:
    """`vllm.LLM`'s keyword arguments for one worker's configuration (its `EngineArgs` fields)."""
    engine = dict(
        model=config["target"],
        dtype=config["dtype"],
        enforce_eager=config["enforce_eager"],
        gpu_memory_utilization=config["gpu_memory_utilization"],
        max_model_len=config["max_model_len"],
        max_num_seqs=config["max_num_seqs"],
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
    return engine


def timed_pass(llm, prompts: list, params, one_at_a_time: bool) -> tuple[dict, list]:
    """The requests decoded once, timed, on caches as empty as a fresh engine's (one warm-up request first): the
    pass's result (with the spec-decode counters of this pass alone) and vLLM's completions."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM did not empty its prefix cache between passes")
    llm.reset_mm_cache()
    llm.llm_engine.reset_encoder_cache()
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    counters_before = spec_counters(llm)
    start = time.perf_counter()
    if one_at_a_time:
        outputs = [out for prompt in prompts for out in llm.generate([prompt], params, use_tqdm=False)]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    counters = {k: v - counters_before.get(k, 0) for k, v in spec_counters(llm).items()}
    completions = [out.outputs[0] for out in outputs]
    requests = []
    for completion in completions:
        metrics = completion.spec_decode_metrics
        accepted = list(metrics.per_step_accepted) if metrics is not None else None
        requests.append(
            {"token_ids": list(completion.token_ids), "acceptance_lengths": [a + 1 for a in accepted or []] or None}
        )
    return {
        "seconds": seconds,
        "output_tokens": sum(len(r["token_ids"]) for r in requests),
        "requests": requests,
        "spec_counters": counters,
    }, completions


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


def run_engine(
    args: ParityArguments,
    draft: str | None,
    num_spec: int,
    max_num_seqs: int,
    concurrencies: list[int],
    workdir: Path,
    check_logprobs: int = 0,
) -> dict:
    """One engine (the target alone, or with `draft`) in its own worker process: with `check_logprobs`, first the
    target check pass (its top log-probabilities kept, at the first concurrency), then one timed pass per
    concurrency. Returns {"target_check": result, concurrency: result, ...}."""
    name = f"{'draft' if draft else 'alone'}_seqs{max_num_seqs}"
    passes = [("target_check", args.concurrency[0], check_logprobs)] if check_logprobs else []
    passes += [(c, c, 0) for c in concurrencies]
    config = {
        **{k: getattr(args, k) for k in ("target", "prompts", "num_prompts", "max_new_tokens", "enforce_eager")},
        **{k: getattr(args, k) for k in ("gpu_memory_utilization", "max_model_len")},
        "dtype": DTYPES[args.precision],
        "draft": draft,
        "num_speculative_tokens": num_spec,
        "max_num_seqs": max_num_seqs,
        "passes": [
            {
                "concurrency": c,
                "logprobs": logprobs,
                "one_at_a_time": c < max_num_seqs,
                "result": str(workdir / f"{name}_{key if key == 'target_check' else f'c{key}'}.json"),
            }
            for key, c, logprobs in passes
        ],
    }
    config_file = workdir / f"{name}.config.json"
    config_file.write_text(json.dumps(config))
    paths = ["--target", args.target, "--draft", args.draft, "--prompts", args.prompts]
    code = launch([sys.executable, str(SCRIPT_PATH), *paths, "--worker", str(config_file)])
    if code != 0:
        raise RuntimeError(f"the vLLM engine {name} failed (exit {code}); its output is above")
    return {key: json.loads(Path(p["result"]).read_text()) for (key, _, _), p in zip(passes, config["passes"])}


def launch(command: list[str]) -> int:
    """Run one worker process to its end; its exit status."""
    return subprocess.run(command, check=False).returncode
