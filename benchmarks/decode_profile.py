"""Where a speculative decoding cycle's time goes, and tokens/s against plain greedy `generate`.

    python benchmarks/decode_profile.py --target HuggingFaceTB/SmolLM2-135M-Instruct \
        --draft runs/smollm2-dflash-b8/draft --data prompts.jsonl --num_prompts 4
    python benchmarks/decode_profile.py --target whisper-base/hf --draft runs/whisper-dflash-b8/draft \
        --data data/speech/eval.json --device cuda --precision bf16
    python benchmarks/decode_profile.py --tiny text      # tiny random target and draft (CPU smoke run)

Batch 1, greedy. Two passes over the same prompts:

1. Un-instrumented: `dflash_hf.generation.evaluation.decode_benchmark`, the wall-clock tokens/s of speculative
   decoding and of the target's own greedy `generate` (same dtype and device, first prompt decoded once untimed),
   outputs checked token-identical.
2. Instrumented: the same speculative decoding with the package's functions wrapped by this benchmark (nothing in
   the package changes): every phase is timed on its own, with a device synchronize at its end (CUDA events on
   `--device cuda`, `time.perf_counter` on the CPU), so the phases add up to the decode's wall time. Its outputs
   must equal the un-instrumented ones.

Phases of the instrumented pass (summed over prompts, also per cycle):

- `setup`: what `speculative_generate` does before the draft/verify loop (the target's `generate` preparing its
  prompt, processors and stopping criteria; Whisper's encoder).
- `prefill`: the target's forward over the prompt.
- `draft`: the draft's forward over a block. With the draft's step replayed as a CUDA graph (`--draft_cuda_graph`,
  default `auto`: on a GPU), `draft` is the whole replayed step, the proposal included (its first call captures
  it), and `proposal` is zero.
- `proposal`: the draft's tokens from its hidden states (`propose_block`: lm_head and argmax, DFlash2's selector).
- `verify`: the target's forward over a block. With the fixed-shape verify (`--verify_cuda_graph`, default `auto`: a
  CUDA graph on a GPU where it can run), the replayed step (block ids and positions copied in, taps and logits out);
  its capture, on the first block of a shape, falls in `setup`.
- `host`: everything else inside the loop; its measured parts are `scores` (the target's logits processors),
  `accept` (acceptance), `stop` (stop checks) and `crop` (KV cache cropping); `host_other` is the rest (block and
  position tensors, sequence growth, Python).

Text targets read `--data` as JSON lines of `{"prompt": ...}` / `{"messages": [...]}` (as `dflash-eval`), or the
`--text_field` (default `text`) of each line of a NeMo manifest as one user turn (chat template when the tokenizer
has one). Speech targets read a NeMo manifest through the package's data layer, as `dflash-eval` does (audio read
with soundfile, features by the target's processor). Results (with the commit, the command and the device) go to
`docs/results/decode_profile_<name>_<device>_<precision>.json`, and a table is printed.

The parts live in `benchmarks/decode_profile_parts/` (arguments, inputs, the instrumented decode, the two passes,
the run's record and table); this script parses the command line, runs the profile and writes the results.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: the checkout's package
    sys.path.insert(0, str(REPO))
if str(Path(__file__).resolve().parent) not in sys.path:  # imported from elsewhere (tests): the parts' package
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_profile_parts.arguments import make_parser  # noqa: E402
from decode_profile_parts.passes import run_profile  # noqa: E402
from decode_profile_parts.record import command_line, write_results  # noqa: E402
from decode_profile_parts.report import results_table  # noqa: E402

RESULTS_DIR = REPO / "docs" / "results"
SCRIPT_PATH = Path(__file__).resolve()


def main(argv: list[str] | None = None) -> dict:
    (args,) = make_parser().parse_args_into_dataclasses(args=argv)
    results = run_profile(args, command_line(SCRIPT_PATH, argv))
    out = (
        Path(args.output_json)
        if args.output_json
        else (
            RESULTS_DIR / f"decode_profile_{results['name']}_{results['device'].split()[0].replace(':', '')}_"
            f"{args.precision}.json"
        )
    )
    write_results(results, out, results_table(results))
    return results


if __name__ == "__main__":
    sys.exit(0 if main()["outputs_identical"] else 1)
