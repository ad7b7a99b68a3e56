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
tokens/s with and without the draft at each `--concurrency` (requests in flight). Each vLLM engine runs in its own
process, and a row starts two for the default concurrencies: the target alone (the target check, then one timed pass
per concurrency) and the target with the draft (one timed pass per concurrency), each with `max_num_seqs` =
max(`--concurrency`); a pass at that concurrency submits every request in one `generate` call, a pass at 1 one
request at a time, and each pass starts on emptied caches with one warm-up request. Any other concurrency (the 4 of
`--concurrency 1 4 8`) cannot be reproduced on a larger engine, so it gets an engine pair of its own with
`max_num_seqs` = 4. Writes a JSON of results (commit, command, devices, versions; per run the engine that served it),
also after each engine (marked `incomplete`: what is left), so a run cut short keeps what it measured; a target check
that fails stops the run after the target's engine, before any engine with the draft starts.

Prompts: JSON lines, one request each: `{"messages": [...]}` (chat messages, rendered with the target's chat
template), `{"prompt": "..."}` (one user turn, rendered the same way) or `{"text": "..."}` (used verbatim); an audio
target's rows add `"audio": "clip.wav"` (the text then holds the family's audio placeholder, as its chat template
renders it). Render prompts the way the draft was trained (its export records the training conversation).

    python benchmarks/vllm_parity.py --target HuggingFaceTB/SmolLM2-135M-Instruct --draft runs/smol/draft \\
        --prompts prompts.jsonl --max_new_tokens 128 --out docs/results/serving_smollm2.json

Needs the serving environment (README, "Serve the draft": `requirements-serving.txt`) and a GPU; `--help` and the
argument checks need neither.

The parts live in `benchmarks/vllm_parity_parts/` (arguments, requests, the vLLM engines, the transformers and
dflash_hf side, the comparisons, one run); this script parses the command line, runs it (or one vLLM engine's
worker) and writes the results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SCRIPT_PATH = Path(__file__).resolve()
REPO = SCRIPT_PATH.parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: the checkout's package
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(SCRIPT_PATH.parent))
from decode_profile_parts.record import command_line  # noqa: E402
from vllm_parity_parts.arguments import make_parser  # noqa: E402
from vllm_parity_parts.engine import run_worker  # noqa: E402
from vllm_parity_parts.parity import run  # noqa: E402


def main(argv: list[str] | None = None) -> dict | None:
    (args,) = make_parser().parse_args_into_dataclasses(args=argv)
    if args.worker:
        run_worker(args.worker)
        return None
    out = Path(args.out)

    def write(record: dict) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")

    results = run(args, command_line(SCRIPT_PATH, argv), save=write)
    write(results)
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
