"""Would Whisper's block verify gain from a CUDA graph, and would it stay exact? (issue 16: the probe behind the
package's opt-in `verify_cuda_graph`, `dflash_hf/verify_graph.py`, whose fixed self-attention cache it uses.)

    python benchmarks/verify_graph_probe.py --target whisper-base/hf --data data/speech/eval.json --device cuda
    python benchmarks/verify_graph_probe.py --tiny       # tiny random Whisper on the CPU (smoke run)

On the H200 the target's forward over a block was half of a speculative cycle (4.31 of 8.4 ms, the tau-3.42 Whisper
draft; docs/PERFORMANCE.md): a launch-bound forward of a few hundred small kernels, as the draft's was before its
step became a CUDA graph. A graph needs fixed shapes, so a static KV cache whose attention is masked over all of its
positions, which may round differently from the growing cache `speculative_generate` verifies with, and a differing
argmax would make the verify's decisions differ from plain `generate`'s. This probe measures both sides.

Per clip, the target's plain greedy `generate` gives the decoder sequence; the verify forwards of a decode are then
replayed teacher-forced along it: a block of `block_size` tokens at anchor position `a` (the first new token's
position first), then `a += step` (`step` about tau). Three ways:

- `dynamic`: `EncoderDecoderCache(DynamicCache(), DynamicCache())`, cropped to `a + step` after each block, as
  `speculative_generate` verifies today;
- `static`: fixed key/value buffers of the decoder's `max_target_positions` per layer, written at the block's
  positions, attention masked over all of them (an explicit 4D mask), position ids given; eager;
- `graph` (CUDA only): the static forward captured as a CUDA graph once per clip, replayed per block.

Reported: the median ms of a verify forward each way, the capture ms, and static against dynamic: the largest
|logit difference| and how many block positions' argmax differ. The tap hooks of the real verify are left out
(the same on every side).
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
from decode_profile import command_line, device_name, git_commit, speech_prompts, write_results  # noqa: E402

from dflash_hf import tiny  # noqa: E402
from dflash_hf.evaluation import target_greedy  # noqa: E402
from dflash_hf.families import generate_kwargs  # noqa: E402
from dflash_hf.speculative import crop_cache  # noqa: E402
from dflash_hf.target import FrozenTarget, load_target  # noqa: E402
from dflash_hf.verify_graph import FixedSelfCache  # noqa: E402

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


def dynamic_pass(model, enc, seq, prompt_len: int, starts: list[int], block: int, step: int, clock: Clock):
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    model(encoder_outputs=enc, decoder_input_ids=seq[:, :prompt_len], past_key_values=cache, use_cache=True)
    logits = []
    for a in starts:
        ids = block_ids(seq, a, block)
        out = clock.time(lambda ids=ids: model(encoder_outputs=enc, decoder_input_ids=ids, past_key_values=cache,
                                               use_cache=True).logits)
        logits.append(out[0].clone())
        crop_cache(cache, a + step)  # as the decode loop: keep the accepted tokens' keys and values
    return logits


class StaticVerify:
    """The verify forward over fixed tensors: the block's ids and positions, a fixed self-attention cache and mask;
    the cross-attention keys/values are the prefill's (computed once per clip)."""

    def __init__(self, model, enc, seq, prompt_len: int, block: int, positions: int):
        self.model, self.enc, self.block = model, enc, block
        dev, dtype = seq.device, model.dtype
        self.dtype = dtype
        cfg = model.config
        heads = cfg.decoder_attention_heads
        self.self_cache = FixedSelfCache(cfg.decoder_layers, heads, cfg.d_model // heads, positions, dtype, dev)
        self.cache = EncoderDecoderCache(self.self_cache, DynamicCache())
        prefill = torch.arange(prompt_len, device=dev)
        self.self_cache.write_index = prefill
        model(encoder_outputs=enc, decoder_input_ids=seq[:, :prompt_len], past_key_values=self.cache, use_cache=True,
              decoder_position_ids=prefill[None], decoder_attention_mask=self.self_cache.keep_mask(prefill, dtype))
        self.ids = torch.zeros(1, block, dtype=torch.long, device=dev)
        self.base = torch.arange(block, device=dev)
        self.pos = self.base.clone()
        self.self_cache.write_index = self.pos
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def forward(self) -> torch.Tensor:
        return self.model(encoder_outputs=self.enc, decoder_input_ids=self.ids, past_key_values=self.cache,
                          use_cache=True, decoder_position_ids=self.pos[None],
                          decoder_attention_mask=self.self_cache.keep_mask(self.pos, self.dtype)).logits

    def capture(self, at: int) -> None:
        """Warm up and capture at position `at` (its writes are overwritten before any block attends to them)."""
        torch.add(self.base, at, out=self.pos)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.forward()

    def __call__(self, ids: torch.Tensor, a: int) -> torch.Tensor:
        self.ids.copy_(ids)
        torch.add(self.base, a, out=self.pos)
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.logits


def static_pass(model, enc, seq, prompt_len, starts, block, positions, clock: Clock, graph: bool,
                capture_ms: list[float]):
    step = StaticVerify(model, enc, seq, prompt_len, block, positions)
    if graph:
        start = time.perf_counter()
        step.capture(positions - block)
        torch.cuda.synchronize()
        capture_ms.append(1e3 * (time.perf_counter() - start))
    return [clock.time(lambda a=a: step(block_ids(seq, a, block), a))[0].clone() for a in starts]


def compare(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    diffs = [(r.float() - o.float()).abs().max().item() for r, o in zip(reference, other)]
    flips = sum(int((r.argmax(-1) != o.argmax(-1)).sum()) for r, o in zip(reference, other))
    return {"max_abs_logit_diff": max(diffs, default=0.0), "argmax_differs": flips,
            "positions": sum(r.shape[0] for r in reference)}


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def setup(args, device: torch.device, workdir: Path):
    if args.tiny:
        model, processor = tiny.build_whisper_target(hidden_size=32, num_heads=2, seed=2)
        ft = FrozenTarget(tiny.sharpen(model, seed=2).to(device))
        manifest = tiny.synthesize_speech(workdir / "speech", args.num_prompts, seed=0)
        return ft, speech_prompts(str(manifest), processor, model.config, args.num_prompts)
    from dflash_hf.cli.train import load_processor

    ft = FrozenTarget(load_target(args.target, args.precision).to(device))
    if not ft.is_encoder_decoder:
        raise ValueError(f"--target {args.target}: the probe is for encoder-decoder (Whisper) targets")
    return ft, speech_prompts(args.data, load_processor(args.target), ft.model.config, args.num_prompts)


@torch.no_grad()
def run(args, command: str) -> dict:
    commit = git_commit()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        ft, prompts = setup(args, device, Path(tmp))
    model = ft.model
    positions = model.config.max_target_positions
    use_graph = device.type == "cuda" and not args.no_graph
    clocks = {"dynamic": Clock(device), "static": Clock(device), "graph": Clock(device)}
    capture_ms: list[float] = []
    exact = {"static": [], "graph": []}
    graph_error = None
    for inputs in tqdm(prompts, desc="clips"):
        inputs = generate_kwargs(ft.family, {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()})
        seq = target_greedy(ft, inputs, args.max_new_tokens)
        prompt_len = inputs["decoder_input_ids"].shape[1]
        starts = [a for a in anchors(prompt_len, seq.shape[1], args.step) if a + args.block_size <= positions]
        enc = model.model.encoder(inputs["input_features"])
        ref = dynamic_pass(model, enc, seq, prompt_len, starts, args.block_size, args.step, clocks["dynamic"])
        exact["static"].append(compare(ref, static_pass(model, enc, seq, prompt_len, starts, args.block_size,
                                                        positions, clocks["static"], False, capture_ms)))
        if use_graph and graph_error is None:
            try:
                exact["graph"].append(compare(ref, static_pass(model, enc, seq, prompt_len, starts, args.block_size,
                                                               positions, clocks["graph"], True, capture_ms)))
            except RuntimeError as err:  # a capture transformers' static path does not allow: say so, go on
                graph_error = f"{type(err).__name__}: {err}"[:2000]
    summary = {}
    for name, rows in exact.items():
        if rows:
            summary[name] = {"max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
                             "argmax_differs": sum(r["argmax_differs"] for r in rows),
                             "positions": sum(r["positions"] for r in rows)}
    ms = {name: median(clock.read()) for name, clock in clocks.items()}
    return {
        "what": "Whisper block verify: growing cache vs fixed key/value buffers, eager and as a CUDA graph",
        "commit": commit, "command": command, "device": device_name(device), "precision": args.precision,
        "target": "tiny random Whisper" if args.tiny else args.target, "clips": len(prompts),
        "block_size": args.block_size, "step": args.step, "verifies": len(clocks["dynamic"].ms),
        "median_ms": ms, "capture_ms_median": median(capture_ms) if use_graph else None,
        "static_vs_dynamic": summary, "graph_error": graph_error,
    }


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="a Whisper checkpoint directory (not with --tiny)")
    p.add_argument("--data", help="a NeMo speech manifest (not with --tiny)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Whisper and synthetic speech (CPU smoke run)")
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
    if args.tiny == bool(args.target or args.data):
        raise SystemExit("give --tiny, or --target and --data")
    if not args.tiny and not (args.target and args.data):
        raise SystemExit("--target and --data go together")
    if not 1 <= args.step <= args.block_size:
        raise SystemExit(f"--step must be in 1..block_size ({args.block_size}), got {args.step}")
    results = run(args, command_line(SCRIPT_PATH, argv))
    out = Path(args.output_json or SCRIPT_PATH.parents[1] / "docs" / "results" /
               f"verify_graph_probe_{torch.device(args.device).type}.json")
    table = "\n".join(
        [f"verify forward, median ms: {results['median_ms']}", f"capture ms: {results['capture_ms_median']}",
         f"static vs dynamic: {results['static_vs_dynamic']}", f"graph error: {results['graph_error']}"])
    write_results(results, out, table)
    return results


if __name__ == "__main__":
    main()
