"""Would the target's block verify gain from a CUDA graph, and would it stay exact? (issue 16: the probe behind the
package's `verify_cuda_graph`, whose `StaticVerifyStep` (`dflash_hf/generation/static_verify.py`) it drives.)

    python benchmarks/verify_graph_probe.py --target whisper-base/hf --data data/speech/eval.json --device cuda
    python benchmarks/verify_graph_probe.py --target smollm2/hf --data data/prompts/eval.jsonl --device cuda
    python benchmarks/verify_graph_probe.py --tiny whisper     # tiny random target on the CPU (smoke run; or text)

On the H200 the target's forward over a block was half of a speculative cycle (4.31 of 8.4 ms, the tau-3.42 Whisper
draft; docs/PERFORMANCE.md): a launch-bound forward of a few hundred small kernels, as the draft's was before its
step became a CUDA graph. A graph needs fixed shapes: fixed key/value buffers whose attention is masked over all of
their rows, which may round differently from the growing cache `speculative_generate` verifies with, and a differing
argmax would make the verify's decisions differ from plain `generate`'s. This probe measures both sides.

Per prompt (a Whisper clip, or a text prompt of JSON lines as `dflash-eval` reads them), the target's greedy decoding
gives the sequence; the verify forwards of a decode are then replayed teacher-forced along it: a block of
`block_size` tokens at anchor position `a` (the first new token's position first), then `a += step` (`step` about
tau). Three ways, each through `FrozenTarget.tapped_forward` (taps included, as in decoding):

- `dynamic`: the growing cache, cropped to `a + step` after each block, as `speculative_generate` verifies on the CPU
  (and on a GPU with `verify_cuda_graph=False`);
- `static`: the package's `StaticVerifyStep` without a graph (fixed buffers, explicit mask, position ids);
- `graph` (CUDA only): the same step captured as a CUDA graph (once per target and shape) and replayed.

Reported: the median ms of a verify forward each way, the capture ms, and static and graph against dynamic: the
largest |logit difference| and how many block positions' argmax differ.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, EncoderDecoderCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile import (  # noqa: E402
    command_line,
    device_name,
    git_commit,
    speech_prompts,
    text_prompts,
    write_results,
)

from dflash_hf.generation.speculative import crop_cache  # noqa: E402
from dflash_hf.generation.static_verify import static_verify_step, static_verify_steps, verify_rows  # noqa: E402
from dflash_hf.targets.families.registry import generate_kwargs  # noqa: E402
from dflash_hf.targets.frozen import FrozenTarget, load_target  # noqa: E402
from dflash_hf.testing import tiny  # noqa: E402
from dflash_hf.training.decode_benchmark import target_greedy  # noqa: E402

SCRIPT_PATH = Path(__file__).resolve()


class Clock:
    """Milliseconds of single calls: CUDA events on a GPU (synchronized when read), perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple] = []
        self.ms: list[float] = []

    def time(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self.pending.append((start, end))
            return out
        start = time.perf_counter()
        out = fn()
        self.ms.append(1e3 * (time.perf_counter() - start))
        return out

    def read(self) -> list[float]:
        if self.pending:
            torch.cuda.synchronize()
            self.ms += [s.elapsed_time(e) for s, e in self.pending]
            self.pending = []
        return self.ms


def anchors(prompt_len: int, length: int, step: int) -> list[int]:
    """The anchor positions of a decode that accepts `step` tokens a cycle, up to the sequence's last token."""
    return list(range(prompt_len, length, step))


def block_ids(seq: torch.Tensor, a: int, block: int) -> torch.Tensor:
    """`[1, block]`: the sequence's tokens from position `a`, the last token repeated past its end."""
    ids = seq[:, a : a + block]
    if ids.shape[1] < block:
        ids = torch.cat([ids, ids[:, -1:].expand(1, block - ids.shape[1])], dim=1)
    return ids


LAYER_IDS = [1]  # one tap: the hooks run as in decoding; which layer does not change the logits


def prefill(ft, inputs: dict, seq: torch.Tensor, prompt_len: int):
    """The prompt's forward into a growing cache: (cache, keywords of every later forward, the ids keyword)."""
    if ft.is_encoder_decoder:
        enc = ft.model.get_encoder()(inputs["input_features"])
        cache, kwargs, key = (
            EncoderDecoderCache(DynamicCache(), DynamicCache()),
            {"encoder_outputs": enc},
            "decoder_input_ids",
        )
    else:
        cache, kwargs, key = DynamicCache(), {}, "input_ids"
    ft.model(past_key_values=cache, use_cache=True, **kwargs, **{key: seq[:, :prompt_len]})
    return cache, kwargs, key


def dynamic_pass(ft, inputs, seq, prompt_len: int, starts: list[int], block: int, step: int, clock: Clock):
    cache, kwargs, key = prefill(ft, inputs, seq, prompt_len)
    logits = []
    for a in starts:
        ids = block_ids(seq, a, block)
        out = clock.time(
            lambda ids=ids: (
                ft.tapped_forward(LAYER_IDS, past_key_values=cache, use_cache=True, **kwargs, **{key: ids})[0].logits
            )
        )
        logits.append(out[0].clone())
        crop_cache(cache, a + step)  # as the decode loop: keep the accepted tokens' keys and values
    return logits


def static_pass(ft, inputs, seq, prompt_len, starts, block, rows, clock: Clock, graph: bool, capture_ms: list[float]):
    cache, kwargs, _ = prefill(ft, inputs, seq, prompt_len)
    kept = list(static_verify_steps(ft.model).values())
    start = time.perf_counter()
    step = static_verify_step(ft, LAYER_IDS, block, rows, cache, kwargs, graph)
    if graph and all(step is not other for other in kept):  # a new step: it was captured just now
        torch.cuda.synchronize()
        capture_ms.append(1e3 * (time.perf_counter() - start))
    return [clock.time(lambda a=a: step.verify(ft, block_ids(seq, a, block), a))[0].clone() for a in starts]


def compare(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    diffs = [(r.float() - o.float()).abs().max().item() for r, o in zip(reference, other)]
    flips = sum(int((r.argmax(-1) != o.argmax(-1)).sum()) for r, o in zip(reference, other))
    return {
        "max_abs_logit_diff": max(diffs, default=0.0),
        "argmax_differs": flips,
        "positions": sum(r.shape[0] for r in reference),
    }


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def setup(args, device: torch.device, workdir: Path):
    if args.tiny == "whisper":
        model, processor = tiny.build_whisper_target(hidden_size=32, num_heads=2, seed=2)
        ft = FrozenTarget(tiny.sharpen(model, seed=2).to(device))
        manifest = tiny.synthesize_speech(workdir / "speech", args.num_prompts, seed=0)
        return ft, speech_prompts(str(manifest), processor, model.config, args.num_prompts)
    if args.tiny == "text":
        tok = tiny.build_tokenizer()
        ft = FrozenTarget(
            tiny.sharpen(tiny.build_text_target(tok, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)).to(
                device
            )
        )
        gen = torch.Generator().manual_seed(0)
        return ft, [{"input_ids": torch.randint(3, 250, (1, 7 + i), generator=gen)} for i in range(args.num_prompts)]
    from dflash_hf.cli.train import load_processor
    from dflash_hf.targets.families.registry import get_tokenizer

    ft = FrozenTarget(load_target(args.target, args.precision).to(device))
    processor = load_processor(args.target)
    if ft.is_encoder_decoder:
        return ft, speech_prompts(args.data, processor, ft.model.config, args.num_prompts)
    if ft.family.has_audio:
        raise ValueError(f"--target {args.target}: the probe takes Whisper or text targets")
    return ft, text_prompts(args.data, get_tokenizer(processor), "text", args.num_prompts)


@torch.no_grad()
def run(args, command: str) -> dict:
    commit = git_commit()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        ft, prompts = setup(args, device, Path(tmp))
    positions = getattr(ft.model.config, "max_target_positions", None)  # Whisper's; None for a text target
    use_graph = device.type == "cuda" and not args.no_graph
    clocks = {"dynamic": Clock(device), "static": Clock(device), "graph": Clock(device)}
    capture_ms: list[float] = []
    exact = {"static": [], "graph": []}
    graph_error = None
    for inputs in tqdm(prompts, desc="prompts"):
        inputs = generate_kwargs(ft.family, {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()})
        seq = target_greedy(ft, inputs, args.max_new_tokens)
        prompt_len = inputs["decoder_input_ids" if ft.is_encoder_decoder else "input_ids"].shape[1]
        rows = verify_rows(positions, prompt_len + args.max_new_tokens, 0, args.block_size)
        starts = [a for a in anchors(prompt_len, seq.shape[1], args.step) if a + args.block_size <= rows]
        ref = dynamic_pass(ft, inputs, seq, prompt_len, starts, args.block_size, args.step, clocks["dynamic"])
        exact["static"].append(
            compare(
                ref,
                static_pass(
                    ft, inputs, seq, prompt_len, starts, args.block_size, rows, clocks["static"], False, capture_ms
                ),
            )
        )
        if use_graph and graph_error is None:
            try:
                exact["graph"].append(
                    compare(
                        ref,
                        static_pass(
                            ft,
                            inputs,
                            seq,
                            prompt_len,
                            starts,
                            args.block_size,
                            rows,
                            clocks["graph"],
                            True,
                            capture_ms,
                        ),
                    )
                )
            except RuntimeError as err:  # a capture transformers' static path does not allow: say so, go on
                graph_error = f"{type(err).__name__}: {err}"[:2000]
    summary = {}
    for name, rows in exact.items():
        if rows:
            summary[name] = {
                "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
                "argmax_differs": sum(r["argmax_differs"] for r in rows),
                "positions": sum(r["positions"] for r in rows),
            }
    ms = {name: median(clock.read()) for name, clock in clocks.items()}
    return {
        "what": "block verify: growing cache vs fixed key/value buffers (StaticVerifyStep), eager and as a CUDA graph",
        "commit": commit,
        "command": command,
        "device": device_name(device),
        "precision": args.precision,
        "target": f"tiny random {args.tiny}" if args.tiny else args.target,
        "prompts": len(prompts),
        "block_size": args.block_size,
        "step": args.step,
        "verifies": len(clocks["dynamic"].ms),
        "median_ms": ms,
        "capture_ms_median": median(capture_ms) if use_graph else None,
        "static_vs_dynamic": summary,
        "graph_error": graph_error,
    }


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="a Whisper or text LLM checkpoint directory (not with --tiny)")
    p.add_argument("--data", help="a NeMo speech manifest (Whisper) or prompts as dflash-eval reads them (text)")
    p.add_argument(
        "--tiny",
        choices=["whisper", "text"],
        default=None,
        help="a tiny random target (and synthetic speech) on the CPU: a smoke run",
    )
    p.add_argument("--num_prompts", type=int, default=40)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--block_size", type=int, default=8)
    p.add_argument("--step", type=int, default=4, help="tokens accepted a cycle (about tau)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--no_graph", action="store_true", help="skip the CUDA graph (the static forward stays)")
    p.add_argument("--output_json", default=None, help="default docs/results/verify_graph_probe_<device>.json")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    if bool(args.tiny) == bool(args.target or args.data):
        raise SystemExit("give --tiny, or --target and --data")
    if not args.tiny and not (args.target and args.data):
        raise SystemExit("--target and --data go together")
    if not 1 <= args.step <= args.block_size:
        raise SystemExit(f"--step must be in 1..block_size ({args.block_size}), got {args.step}")
    results = run(args, command_line(SCRIPT_PATH, argv))
    out = Path(
        args.output_json
        or SCRIPT_PATH.parents[1] / "docs" / "results" / f"verify_graph_probe_{torch.device(args.device).type}.json"
    )
    table = "\n".join(
        [
            f"verify forward, median ms: {results['median_ms']}",
            f"capture ms: {results['capture_ms_median']}",
            f"static vs dynamic: {results['static_vs_dynamic']}",
            f"graph error: {results['graph_error']}",
        ]
    )
    write_results(results, out, table)
    return results


if __name__ == "__main__":
    main()
