"""Serving parity in vLLM: a target served alone and with a DFlash / DFlash2 draft through vLLM's offline `LLM` API
(greedy), against `dflash_hf`'s own speculative decoding of the same prompts.

Target first: before any draft run, the target alone in vLLM is compared with transformers' greedy `generate` on the
same prompts (`serving_checks.compare_target`: identical outputs, first divergence and the two logits margins there,
numerics or not); with `--stop_if_target_differs` (the default) a divergence that is not a near tie stops the run
there, results written. Every results JSON records the versions of vLLM, torch, transformers and dflash_hf and the
class vLLM's `ModelRegistry` resolved for the target (the plugin's variant for the families it serves).

Then, per request, it checks that vLLM's output with the draft equals vLLM's own greedy output without it, compares the
acceptance lengths vLLM measured (its per-request speculative-decoding metrics, and its counters) with those of
`dflash_hf.generation.speculative_generate` (what `dflash-eval` runs) on the same prompts, and measures output
tokens/s with and without the draft at each `--concurrency` (vLLM's `max_num_seqs`). Each vLLM configuration runs in
its own process (one engine per process). Writes a JSON of results (commit, command, devices, versions).

Prompts: JSON lines, one request each: `{"messages": [...]}` (chat messages, rendered with the target's chat
template), `{"prompt": "..."}` (one user turn, rendered the same way) or `{"text": "..."}` (used verbatim); an audio
target's rows add `"audio": "clip.wav"` (the text then holds the family's audio placeholder, as its chat template
renders it). Render prompts the way the draft was trained (its export records the training conversation).

    python benchmarks/vllm_parity.py --target HuggingFaceTB/SmolLM2-135M-Instruct --draft runs/smol/draft \\
        --prompts prompts.jsonl --max_new_tokens 128 --out docs/results/serving_smollm2.json

Needs the serving environment (README, "Serve the draft": `requirements-serving.txt`) and a GPU; `--help` and the
argument checks need neither.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

SCRIPT_PATH = Path(__file__).resolve()
REPO = SCRIPT_PATH.parents[1]
sys.path.insert(0, str(SCRIPT_PATH.parent))
from decode_profile import command_line, git_commit  # noqa: E402
from serving_checks import (  # noqa: E402
    TIE_MARGIN,
    TOP_LOGPROBS,
    compare_target,
    serving_class,
    top_logprobs,
    transformers_greedy,
    versions,
    vllm_environment,
)

from dflash_hf.errors import DFlashUserError  # noqa: E402

PROMPT_KEYS = ("messages", "prompt", "text")
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass
class ParityArguments:
    target: str = field(metadata={"help": "The target: a Hub id or a local directory (model and tokenizer/processor)."})
    draft: str = field(metadata={"help": "The draft export directory (dflash-train's export)."})
    prompts: str = field(metadata={"help": "JSON lines of requests (see the module docstring)."})
    out: str = field(default="vllm_parity.json", metadata={"help": "Where the results JSON is written."})
    num_prompts: int = field(default=0, metadata={"help": "Requests from the start of --prompts; 0 = all."})
    max_new_tokens: int = field(default=128, metadata={"help": "Tokens decoded per request (every decoder)."})
    concurrency: list[int] = field(
        default_factory=lambda: [1, 8],
        metadata={"help": "Requests in flight for the throughput rows (vLLM's max_num_seqs); parity uses the first."},
    )
    precision: str = field(default="bf16", metadata={"help": "bf16 or fp32, for vLLM and dflash_hf alike."})
    enforce_eager: bool = field(default=True, metadata={"help": "vLLM without CUDA graphs or torch.compile."})
    gpu_memory_utilization: float = field(default=0.8, metadata={"help": "vLLM's share of GPU memory."})
    max_model_len: int = field(default=4096, metadata={"help": "vLLM's longest sequence (prompt + output)."})
    skip_dflash_hf: bool = field(default=False, metadata={"help": "Measure vLLM only (no dflash_hf tau)."})
    target_check: bool = field(
        default=True, metadata={"help": "First compare the target alone in vLLM with transformers' greedy generate."}
    )
    stop_if_target_differs: bool = field(
        default=True,
        metadata={"help": "Stop after the target check when an output differs by more than a near tie."},
    )
    tie_margin: float | None = field(
        default=None,
        metadata={"help": f"transformers' logit margin of a near tie (numerics); default by precision {TIE_MARGIN}."},
    )
    worker: str | None = field(default=None, metadata={"help": "Internal: run one vLLM configuration (a JSON file)."})

    def __post_init__(self):
        if self.precision not in DTYPES:
            raise DFlashUserError(f"--precision must be one of {sorted(DTYPES)}, got {self.precision!r}")
        if self.num_prompts < 0:
            raise DFlashUserError(f"--num_prompts must be >= 0 (0 = all), got {self.num_prompts}")
        if self.max_new_tokens < 1:
            raise DFlashUserError(f"--max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise DFlashUserError(f"--concurrency takes positive request counts, got {self.concurrency}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise DFlashUserError(f"--gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tie_margin is not None and self.tie_margin < 0:
            raise DFlashUserError(f"--tie_margin must be >= 0, got {self.tie_margin}")
        if self.tie_margin is None:
            self.tie_margin = TIE_MARGIN[self.precision]
        if self.worker is None:
            for name in ("draft", "prompts"):
                if not Path(getattr(self, name)).exists():
                    raise DFlashUserError(f"--{name} {getattr(self, name)} does not exist")
            if not (Path(self.draft) / "config.json").is_file():
                raise DFlashUserError(f"--draft {self.draft} has no config.json: give a draft export directory")


def make_parser():
    from transformers import HfArgumentParser

    return HfArgumentParser(ParityArguments)


# ------------------------------------------------------------------------------------------------
# Requests
# ------------------------------------------------------------------------------------------------
def read_requests(path: str | Path, limit: int = 0) -> list[dict]:
    """The request rows of a JSON-lines file, checked before anything loads; a bad row names its line and the fix."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DFlashUserError(f"{where} is not JSON ({err.msg}); one request object per line") from err
        if not isinstance(row, dict):
            raise DFlashUserError(f"{where} holds a JSON {type(row).__name__}; one request object per line")
        given = [k for k in PROMPT_KEYS if k in row]
        if len(given) != 1:
            raise DFlashUserError(f"{where} needs exactly one of {list(PROMPT_KEYS)}, has {given or 'none'}")
        if given[0] == "messages" and not (isinstance(row["messages"], list) and row["messages"]):
            raise DFlashUserError(f"{where}: 'messages' must be a non-empty list of chat messages")
        if given[0] != "messages" and not isinstance(row[given[0]], str):
            raise DFlashUserError(f"{where}: {given[0]!r} must be a string")
        audio = row.get("audio")
        if audio is not None:
            clip = Path(audio) if Path(audio).is_absolute() else Path(path).parent / audio
            if not clip.is_file():
                raise DFlashUserError(f"{where}: audio file {audio} does not exist")
            row = {**row, "audio": str(clip)}
        rows.append(row)
        if limit and len(rows) == limit:
            break
    if not rows:
        raise DFlashUserError(f"{path} holds no requests")
    return rows


def render(row: dict, tokenizer, processor=None) -> str | list[int]:
    """A request's prompt: its text (`text`, or an audio request's rendered chat), or a text request's token ids. An
    audio request renders with the processor's chat template where it has one (what dflash-train renders audio
    conversations with), else the tokenizer's."""
    if "text" in row:
        return row["text"] if row.get("audio") else tokenizer(row["text"], add_special_tokens=False)["input_ids"]
    messages = row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]
    tokenize = not row.get("audio")
    owner = processor if not tokenize and getattr(processor, "chat_template", None) else tokenizer
    out = owner.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize)
    return list(out["input_ids"] if isinstance(out, Mapping) else out) if tokenize else out


def load_audio(path: str, sampling_rate: int):
    import soundfile

    wave, rate = soundfile.read(path, dtype="float32", always_2d=True)
    if rate != sampling_rate:
        raise DFlashUserError(f"{path} is sampled at {rate} Hz; the target's processor takes {sampling_rate} Hz")
    return wave.mean(axis=1)


def load_processor(target: str):
    from transformers import AutoProcessor, AutoTokenizer

    try:
        processor = AutoProcessor.from_pretrained(target)
    except (OSError, ValueError):
        processor = AutoTokenizer.from_pretrained(target)
    return processor, getattr(processor, "tokenizer", processor)


def sampling_rate_of(processor) -> int:
    return getattr(getattr(processor, "feature_extractor", None), "sampling_rate", 16000)


def vllm_prompts(rows: list[dict], target: str) -> list[dict]:
    processor, tokenizer = load_processor(target)
    prompts = []
    for row in rows:
        prompt = render(row, tokenizer, processor)
        if row.get("audio"):
            rate = sampling_rate_of(processor)
            prompts.append({"prompt": prompt, "multi_modal_data": {"audio": (load_audio(row["audio"], rate), rate)}})
        else:
            prompts.append({"prompt_token_ids": prompt})
    return prompts


# ------------------------------------------------------------------------------------------------
# vLLM, one configuration per process
# ------------------------------------------------------------------------------------------------
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


# ------------------------------------------------------------------------------------------------
# dflash_hf on the same requests
# ------------------------------------------------------------------------------------------------
def load_reference(args: ParityArguments):
    """The target as transformers runs it (`dflash_hf`'s frozen target, in `--precision`, on the GPU if there is one),
    and each request's inputs for its `generate`."""
    import torch

    from dflash_hf.generation.target_generate import generate_inputs
    from dflash_hf.targets.frozen import FrozenTarget, load_target

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = FrozenTarget(load_target(args.target, args.precision).to(device))
    processor, tokenizer = load_processor(args.target)
    prepared = []
    for row in read_requests(args.prompts, args.num_prompts):
        prompt = render(row, tokenizer, processor)
        if row.get("audio"):
            rate = sampling_rate_of(processor)
            inputs = processor(
                text=[prompt], audio=[load_audio(row["audio"], rate)], sampling_rate=rate, return_tensors="pt"
            )
        else:
            ids = torch.tensor([prompt])
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        prepared.append(generate_inputs(target, {k: v.to(device) for k, v in inputs.items()}))
    return target, prepared


def run_dflash_hf(args: ParityArguments, reference=None) -> list[dict]:
    """Per request: new token ids and acceptance lengths of `speculative_generate` (greedy), as dflash-eval decodes."""
    from dflash_hf.export.drafts import load_draft_strict
    from dflash_hf.generation.speculative import speculative_generate
    from dflash_hf.targets.frozen import resolve_dtype

    target, prepared = reference or load_reference(args)
    draft = load_draft_strict(args.draft).to(device=target.device, dtype=resolve_dtype(args.precision)).eval()
    results = []
    for inputs in prepared:
        out = speculative_generate(draft, target, args.max_new_tokens, **inputs)
        new = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        results.append({"token_ids": new, "acceptance_lengths": list(out.acceptance_lengths)})
    return results


# ------------------------------------------------------------------------------------------------
# Comparison
# ------------------------------------------------------------------------------------------------
def strip_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """The new tokens without a final end token (vLLM and generate both keep it; counted once either way)."""
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def compare(alone: dict, drafted: dict, ours: list[dict] | None, eos: set[int]) -> dict:
    """Per-request parity: vLLM with the draft against vLLM alone (greedy), acceptance against dflash_hf's."""
    pairs = list(zip(alone["requests"], drafted["requests"]))
    mismatched = [
        i for i, (a, d) in enumerate(pairs) if strip_eos(a["token_ids"], eos) != strip_eos(d["token_ids"], eos)
    ]
    vllm_lengths = [n for _, d in pairs for n in d["acceptance_lengths"] or []]
    counters = drafted["spec_counters"]
    out = {
        "requests": len(pairs),
        "outputs_equal_to_vllm_greedy": len(pairs) - len(mismatched),
        "mismatched_requests": mismatched,
        "tau_vllm": mean(vllm_lengths),
        "tau_vllm_counters": 1 + counters["accepted_tokens"] / counters["drafts"] if counters.get("drafts") else None,
    }
    if ours is not None:
        ours_lengths = [n for r in ours for n in r["acceptance_lengths"]]
        same = [
            i
            for i, ((_, d), r) in enumerate(zip(pairs, ours))
            if d["acceptance_lengths"] is not None and d["acceptance_lengths"] == r["acceptance_lengths"]
        ]
        out.update(
            tau_dflash_hf=mean(ours_lengths),
            identical_acceptance_sequences=len(same),
            identical_acceptance_share=len(same) / len(pairs) if pairs else None,
            dflash_hf_outputs_equal_to_vllm_greedy=sum(
                strip_eos(a["token_ids"], eos) == strip_eos(r["token_ids"], eos) for (a, _), r in zip(pairs, ours)
            ),
        )
    return out


def eos_ids(target: str) -> set[int]:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(target).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = load_processor(target)[1].eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"


def reference_greedy(args: ParityArguments, eos: set[int]) -> list[dict]:
    """transformers' greedy `generate` of the requests, run before any vLLM engine starts; the model is released
    after (vLLM takes its share of the GPU's memory)."""
    import gc

    import torch

    reference = load_reference(args)
    greedy = transformers_greedy(reference[0].model, reference[1], args.max_new_tokens, eos)
    del reference
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return greedy


def check_target(args: ParityArguments, greedy: list[dict], workdir: Path, eos: set[int]) -> dict:
    """The target alone in vLLM (its top log-probabilities kept) against transformers' greedy `generate`."""
    served = run_vllm(args, None, args.concurrency[0], 0, workdir, logprobs=TOP_LOGPROBS)
    check = compare_target(served["requests"], greedy, args.tie_margin, lambda t: strip_eos(t, eos))
    check["serving_class"] = served["serving_class"]
    check["transformers_token_ids"] = [g["token_ids"] for g in greedy]
    check["vllm_token_ids"] = [r["token_ids"] for r in served["requests"]]
    return check


def run(args: ParityArguments, command: str) -> dict:
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
        if target_check is not None and not target_check["passed"] and args.stop_if_target_differs:
            return {**header, "target_check": target_check, "stopped": "the target alone differs from transformers"}
        runs = {
            c: (run_vllm(args, None, c, 0, Path(tmp)), run_vllm(args, args.draft, c, block - 1, Path(tmp)))
            for c in args.concurrency
        }
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
        "runs": {str(c): {"target_alone": a, "with_draft": d} for c, (a, d) in runs.items()},
        "dflash_hf": ours,
    }


def main(argv: list[str] | None = None) -> dict | None:
    (args,) = make_parser().parse_args_into_dataclasses(args=argv)
    if args.worker:
        run_worker(args.worker)
        return None
    results = run(args, command_line(SCRIPT_PATH, argv))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    check = results["target_check"]
    if check is not None:
        print(
            f"target alone: {check['identical']}/{check['requests']} outputs identical to transformers' greedy; "
            f"divergences not explained by numerics: {check['divergences_not_numerics'] or 'none'}"
        )
    if "stopped" in results:
        raise SystemExit(f"stopped: {results['stopped']} (--stop_if_target_differs); results written to {out}")
    p = results["parity"]
    print(
        f"{p['outputs_equal_to_vllm_greedy']}/{p['requests']} outputs equal to vLLM's greedy; tau vLLM "
        f"{p['tau_vllm']}, dflash_hf {p.get('tau_dflash_hf')}; results written to {out}"
    )
    return results


if __name__ == "__main__":
    main()
