"""Training-step benchmark of DFlash drafts at realistic shapes (random weights), through the product path.

Every timed step is `DFlashObjective.loss` + `normalize` -> `backward` -> gradient clipping -> AdamW step, what
`Trainer.train` runs per micro-batch. Two rates: the median of steps timed one by one (CUDA events, the device
drained after each), and the pipelined mean of back-to-back steps with one synchronization at the end. Two modes:

- `draft`: the draft side alone. The target's forward is replaced by fixed random taps (`FixedTapsTarget`),
  labels are the data tokens; blocks, mask, draft forward/backward, chunked lm_head + CE and AdamW are timed.
- `full`: the whole step, the frozen target's forward with tap hooks and `target_argmax` labels included.

Anchors are drawn on the CPU by `DFlashObjective.plan` before the step (the trainer does it in
`get_batch_samples`, before any forward); that CPU time is reported separately as `plan_ms` (median of 5).

FLOP counting (model FLOPs, what the math needs; recomputation is not counted):

- draft layers on the block tokens `Q = b*N*B`: q/k/v/o projections and the SwiGLU MLP, `2*m*n*k` per matmul;
- context tokens `S`: `fc` (`n_taps*H -> H`) once, K/V projections of every layer;
- attention: `4 * d * heads` per visible (query, key) pair (QK^T and PV), pairs counted from the mask;
- trained matmuls x3 (forward, input grad, weight grad); `fc` x2 (its input, the taps, needs no grad);
  attention x3 (forward, and dQ/dK + dV/dP in backward);
- frozen lm_head on the valid slots x2 (forward + input grad);
- `full` adds the target forward (x1): projections, MLP and causal attention of every layer, and the
  `target_argmax` label projection of the supervised positions.

MFU = model FLOP/s over the bf16 matmul rate measured in the same run (an `n^3` matmul, median of timed runs).

    python scripts/benchmark_train.py --shape qwen3-8b --out results.json
    python scripts/benchmark_train.py --tiny --out tiny.json   # CPU regression run
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_hf.blocks import build_blocks, dense_block_mask  # noqa: E402
from dflash_hf.configuration_dflash import DFlashConfig  # noqa: E402
from dflash_hf.losses import MetricSums  # noqa: E402
from dflash_hf.modeling_dflash import DFlashDraftModel  # noqa: E402
from dflash_hf.target import FrozenTarget, TargetFeatures  # noqa: E402
from dflash_hf.trainer import DFlashTrainer  # noqa: E402
from dflash_hf.training_args import DFlashTrainingArguments  # noqa: E402

SHAPES = {
    "qwen3-1.7b": dict(
        hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=6144, vocab_size=151936, seq_len=1024, num_anchors=256,
    ),
    "qwen3-8b": dict(
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=12288, vocab_size=151936, seq_len=3072, num_anchors=512,
    ),
    "tiny": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=512, seq_len=96, num_anchors=16,
    ),
}
GPU_CONFIGS = (
    "attn=flex,ce=2048",
    "attn=sdpa,ce=2048",
    "attn=flex,ce=1024",
    "attn=flex,ce=4096",
    "attn=flex,ce=2048,ckpt=1",
    "attn=flex,ce=2048,compile=layers",
)
CPU_CONFIGS = ("attn=sdpa,ce=64", "attn=sdpa,ce=64,ckpt=1")
CONFIG_DEFAULTS = {"attn": "flex", "ce": "2048", "ckpt": "0", "compile": "none"}


def parse_config(spec: str) -> dict:
    """`attn=flex,ce=2048,ckpt=0,compile=none` -> dict (missing keys take CONFIG_DEFAULTS)."""
    cfg = dict(CONFIG_DEFAULTS)
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in CONFIG_DEFAULTS:
            raise ValueError(f"bad config item {item!r} in {spec!r}; keys: {sorted(CONFIG_DEFAULTS)}")
        cfg[key] = value
    if cfg["attn"] not in ("flex", "sdpa") or cfg["compile"] not in ("none", "layers"):
        raise ValueError(f"bad config {spec!r}: attn is flex|sdpa, compile is none|layers")
    return cfg


class FixedTapsTarget(FrozenTarget):
    """The frozen target with its forward replaced by fixed random taps: times the draft side alone."""

    def __init__(self, model, taps: torch.Tensor):
        super().__init__(model)
        self.taps = taps

    def capture(self, batch, layer_ids, keep_final=False) -> TargetFeatures:
        return TargetFeatures(taps=self.taps, final_hidden=None)


# ------------------------------------------------------------------------------------------------
# Timing helpers
# ------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, device: torch.device, warmup: int, steps: int) -> list[float]:
    """Per-call milliseconds (CUDA events on GPU, perf_counter on CPU) after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _pipelined_ms(fn, device: torch.device, steps: int) -> float:
    """Mean milliseconds per call of `steps` back-to-back calls with one synchronization at the end: the rate
    of a training loop that never waits for the device between steps."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def profile_steps(fn, steps: int, path: Path) -> dict:
    """`torch.profiler` over `steps` calls: writes the operator table (by device time) to `path`, returns the
    device-busy milliseconds per step (sum of kernel times) next to the wall milliseconds per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()  # listed in host_waits under profile_steps
    wall = (time.perf_counter() - t0) * 1e3 / steps
    events = prof.key_averages()
    tables = [events.table(sort_by=key, row_limit=50, max_name_column_width=90)
              for key in ("self_device_time_total", "cpu_time_total")]
    path.write_text("\n\n".join(tables))
    busy_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return {
        "profiled_wall_ms": round(wall, 3),
        "device_busy_ms": round(busy_us / 1e3 / steps, 3),
        "host_waits": host_waits(prof.events()),
    }


def host_waits(events) -> dict[str, dict]:
    """Every host wait for the device inside the profiled steps (`cudaStreamSynchronize`, `cudaEventSynchronize`,
    `cudaDeviceSynchronize`): its operator chain, innermost Python frames and the top-level operator that ran
    just before it on the same thread (the site when no Python frame is recorded), with count and total ms.
    This finds waits that the CUDA sync debug mode does not flag."""
    top = sorted((e for e in events if e.cpu_parent is None and e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: e.time_range.start)
    waits: dict[str, dict] = {}
    for e in events:
        if e.name not in ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize"):
            continue
        chain, parent, stack, root = [e.name], e.cpu_parent, [], e
        while parent is not None:
            chain.append(parent.name)
            stack = stack or [f for f in parent.stack if "torch/profiler" not in f][:6]
            root, parent = parent, parent.cpu_parent
        before = [t.name for t in top if t.thread == root.thread and t.time_range.end <= root.time_range.start]
        key = " <- ".join(chain[:5]) + " @ " + " | ".join(stack) + " after " + " > ".join(before[-3:])
        site = waits.setdefault(key, {"count": 0, "ms": 0.0})
        site["count"] += 1
        site["ms"] = round(site["ms"] + e.cpu_time_total / 1e3, 3)
    return waits


def matmul_tflops(n: int, dtype: torch.dtype, device: torch.device, warmup: int = 3, steps: int = 10) -> float:
    """Measured matmul ceiling: median TFLOP/s of an n^3 product on random data."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = statistics.median(_time_ms(lambda: a @ b, device, warmup, steps))
    return 2 * n**3 / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------------------------------
# FLOPs
# ------------------------------------------------------------------------------------------------
def draft_flops(cfg: DFlashConfig, seq_len: int, batch: int, n_blocks: int, visible_pairs: int, valid_slots: int):
    """Model FLOPs of one draft training step (forward + backward), broken down."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nh, nkv, layers = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    q_tok, s_tok = n_blocks * cfg.block_size, batch * seq_len
    per_layer_block = 2 * q_tok * h * (2 * nh * d + 2 * nkv * d) + 2 * q_tok * 3 * h * i
    per_layer_ctx = 2 * s_tok * h * 2 * nkv * d
    out = {
        "draft_block_matmuls": 3 * layers * per_layer_block,
        "draft_context_kv": 3 * layers * per_layer_ctx,
        "fc": 2 * 2 * s_tok * cfg.num_taps * h * h,
        "attention": 3 * layers * 4 * d * nh * visible_pairs,
        "lm_head": 2 * 2 * valid_slots * h * cfg.vocab_size,
    }
    return out


def target_flops(tcfg: Qwen3Config, seq_len: int, batch: int, supervised: int) -> dict:
    """Model FLOPs of the frozen target's forward (causal attention) and of the target_argmax labels."""
    h, d, i = tcfg.hidden_size, tcfg.head_dim, tcfg.intermediate_size
    nh, nkv = tcfg.num_attention_heads, tcfg.num_key_value_heads
    tok = batch * seq_len
    per_layer = 2 * tok * h * (2 * nh * d + 2 * nkv * d) + 2 * tok * 3 * h * i
    causal_pairs = batch * seq_len * (seq_len + 1) // 2
    per_layer += 4 * d * nh * causal_pairs
    return {
        "target_forward": tcfg.num_hidden_layers * per_layer,
        "target_argmax_labels": 2 * supervised * h * tcfg.vocab_size,
    }


# ------------------------------------------------------------------------------------------------
# Setup
# ------------------------------------------------------------------------------------------------
def build_target(shape: dict, dtype: torch.dtype, device: torch.device) -> Qwen3ForCausalLM:
    tcfg = Qwen3Config(
        hidden_size=shape["hidden_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        intermediate_size=shape["intermediate_size"],
        vocab_size=shape["vocab_size"],
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        attn_implementation="sdpa",
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(tcfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def make_batch(shape: dict, seq_len: int, batch: int, mask_token_id: int, seed: int) -> dict:
    """Random ids (never the mask, pad or eos ids); the first eighth of each row is the unsupervised prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, mask_token_id, (batch, seq_len), generator=g)
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    loss_mask[:, seq_len // 8 :] = True
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


class LoopTimer(TrainerCallback):
    """Wall time of the optimizer steps after `warmup` ones, as `Trainer.train` runs them (the device is drained
    once at the start and once at the end of the timed span, nowhere else)."""

    def __init__(self, warmup: int):
        self.warmup, self.start, self.end, self.steps = warmup, None, None, 0

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            _sync(args.device)
            self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.start is not None:
            self.steps += 1

    def on_train_end(self, args, state, control, **kwargs):
        _sync(args.device)
        self.end = time.perf_counter()

    @property
    def ms_per_step(self) -> float:
        return (self.end - self.start) * 1e3 / self.steps


class SyncWatch(TrainerCallback):
    """CUDA sync debug mode "warn" from optimizer step `start` on (compilation happens before)."""

    def __init__(self, start: int):
        self.start = start

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.start:
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_end(self, args, state, control, **kwargs):
        torch.cuda.set_sync_debug_mode("default")


def _train_on(trainer: DFlashTrainer, batch: dict, steps: int, callback: TrainerCallback) -> None:
    """`trainer.train()` for `steps` optimizer steps on `batch` repeated (the collator hands out the CPU batch;
    the Trainer moves it, plans anchors, clips, steps AdamW and logs as in a real run)."""
    trainer.train_dataset = [0] * steps
    trainer.data_collator = lambda items: {k: v.clone() for k, v in batch.items()}
    trainer.args.max_steps = steps
    trainer.add_callback(callback)
    try:
        trainer.train()
    finally:
        trainer.remove_callback(callback)


def trainer_loop_ms(trainer: DFlashTrainer, batch: dict, warmup: int, steps: int) -> float:
    """Milliseconds per optimizer step of `Trainer.train` after `warmup` steps."""
    timer = LoopTimer(warmup)
    _train_on(trainer, batch, warmup + steps, timer)
    return timer.ms_per_step


def _sync_warning_sites(caught) -> dict[str, int]:
    sites = Counter(
        f"{Path(w.filename).name}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message)
    )
    return dict(sites.most_common())


def sync_sites(trainer: DFlashTrainer, batch: dict, steps: int = 3) -> dict[str, int]:
    """Where `Trainer.train` steps synchronize with the device: `file:line` of each synchronizing call site
    (CUDA sync debug mode) in steps 2..`steps`, with counts."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_on(trainer, batch, steps, SyncWatch(1))
    return _sync_warning_sites(caught)


def step_sync_sites(fn) -> dict[str, int]:
    """The same for one call of the timed step function."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return _sync_warning_sites(caught)


def make_trainer(target, draft, config: dict, mode: str, num_anchors: int, out_dir: str) -> DFlashTrainer:
    args = DFlashTrainingArguments(
        output_dir=out_dir,
        optim="adamw_torch_fused" if target.device.type == "cuda" else "adamw_torch",
        learning_rate=6e-4,
        lr_scheduler_type="constant",
        save_strategy="no",
        logging_steps=10_000,
        disable_tqdm=True,
        precision="bf16" if target.dtype == torch.bfloat16 else "fp32",
        attention_backend=config["attn"],
        ce_chunk_size=int(config["ce"]),
        compile_draft_layers=config["compile"] == "layers",
        num_anchors=num_anchors,
        label_source="target_argmax" if mode == "full" else "ground_truth",
        use_cpu=target.device.type == "cpu",
        per_device_train_batch_size=1,
        report_to="none",
    )
    return DFlashTrainer(model=draft, args=args, target=target)


def run_case(name, shape, tmodel, mode, spec, args, device, dtype, ceiling_tflops) -> dict:
    config = parse_config(spec)
    seq_len, batch, num_anchors = args.seq_len or shape["seq_len"], args.batch_size, args.num_anchors
    num_anchors = num_anchors or shape["num_anchors"]
    tcfg = tmodel.config
    dcfg = DFlashConfig.from_target_config(
        tcfg, mask_token_id=tcfg.vocab_size - 1, num_hidden_layers=args.draft_layers, block_size=args.block_size
    )
    torch._dynamo.reset()  # each case compiles from scratch (static shapes), not on top of the previous ones
    torch.manual_seed(0)
    with torch.device(device):
        draft = DFlashDraftModel(dcfg).to(dtype)
    draft.train()
    if config["ckpt"] == "1":
        # transformers >= 5.23 names it activation_checkpointing_enable (the old name warns)
        enable = getattr(draft, "activation_checkpointing_enable", None) or draft.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    if mode == "draft":
        taps = torch.randn(batch, seq_len, dcfg.num_taps * dcfg.hidden_size, device=device, dtype=dtype)
        target = FixedTapsTarget(tmodel, taps)
    else:
        target = FrozenTarget(tmodel)
    out_dir = tempfile.mkdtemp(prefix="dflash-bench-")
    trainer = make_trainer(target, draft, config, mode, num_anchors, out_dir)
    cpu_batch = make_batch(shape, seq_len, batch, dcfg.mask_token_id, seed=1)
    objective, ft = trainer.objective, trainer.target
    plan = objective.plan(ft, cpu_batch, seed=0)  # the first call pays one-time costs; plan_ms is the median after
    plan_ms = statistics.median(_time_ms(lambda: objective.plan(ft, cpu_batch, seed=0), torch.device("cpu"), 0, 5))
    dev_batch = {k: v.to(device) for k, v in cpu_batch.items()}
    optimizer = torch.optim.AdamW(draft.parameters(), lr=6e-4, fused=device.type == "cuda")

    denom = plan.denominator.to(device)  # get_batch_samples hands the global denominator over on the device

    sums = MetricSums()

    def step():  # what DFlashTrainer.compute_loss runs (metric sums included), without the Trainer
        out = objective.loss(draft, ft, dev_batch, plan)
        loss, skipped = objective.normalize(out, denom, training_step=True)
        objective.record(sums, out, plan, skipped)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), trainer.args.max_grad_norm)  # as Trainer does
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # FLOPs from the exact blocks and mask of this plan.
    blocks = build_blocks(
        cpu_batch["input_ids"], cpu_batch["input_ids"], plan.loss_mask, plan.doc_ids, plan.positions, plan.anchors,
        dcfg.block_size, dcfg.mask_token_id, objective.gamma,
    )
    visible = int(dense_block_mask(plan.anchors, plan.doc_ids, dcfg.block_size).sum())
    n_blocks = plan.anchors.numel()
    flops = draft_flops(dcfg, seq_len, batch, n_blocks, visible, int(blocks.valid.sum()))
    if mode == "full":
        flops.update(target_flops(tcfg, seq_len, batch, int(plan.loss_mask[:, 1:].sum())))
    total = sum(flops.values())

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    static = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    times = _time_ms(step, device, args.warmup, args.steps)
    ms = statistics.median(times)
    pipelined = _pipelined_ms(step, device, args.steps)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    loop = {}
    if args.trainer_loop:
        loop_ms = trainer_loop_ms(trainer, cpu_batch, args.warmup, args.steps)
        loop_mfu = total / (loop_ms * 1e-3) / 1e12 / ceiling_tflops
        loop = {"ms_trainer_loop": round(loop_ms, 3), "mfu_trainer_loop": round(loop_mfu, 4)}
        if device.type == "cuda":
            loop["trainer_sync_sites"] = sync_sites(trainer, cpu_batch)
    profiled = {}
    if args.profile and device.type == "cuda":
        tag = f"{name}_{mode}_{spec}".replace(",", "_").replace("=", "-")
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        profiled = profile_steps(step, 3, Path(args.profile) / f"{tag}.txt")
        profiled["step_sync_sites"] = step_sync_sites(step)
    shutil.rmtree(out_dir, ignore_errors=True)
    tflops = total / (ms * 1e-3) / 1e12
    return {
        "shape": name,
        "mode": mode,
        "config": spec,
        "seq_len": seq_len,
        "batch_size": batch,
        "num_anchors": num_anchors,
        "block_size": args.block_size,
        "draft_layers": args.draft_layers,
        "blocks": n_blocks,
        "visible_pairs": visible,
        "ms_per_step": round(ms, 3),
        "ms_min": round(min(times), 3),
        "ms_max": round(max(times), 3),
        "ms_pipelined": round(pipelined, 3),
        "mfu_pipelined": round(total / (pipelined * 1e-3) / 1e12 / ceiling_tflops, 4),
        **loop,
        **profiled,
        "plan_ms": round(plan_ms, 3),
        "tokens_per_s": round(batch * seq_len / (ms * 1e-3), 1),
        "block_tokens_per_s": round(n_blocks * args.block_size / (ms * 1e-3), 1),
        "model_tflop_per_step": round(total / 1e12, 6),
        "matmul_tflops": round(ceiling_tflops, 4),
        "flops": flops,
        "tflops": round(tflops, 4),
        "mfu": round(tflops / ceiling_tflops, 4),
        "static_gib": round(static / 2**30, 3),
        "peak_gib": round(peak / 2**30, 3),
    }


def run_isolated(args: argparse.Namespace, name: str, mode: str, spec: str) -> dict:
    """One case in a fresh Python process, so that compiled state (dynamo caches and recompile counts) cannot leak
    from one case into the next. Its MFU is against the matmul ceiling measured in that process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        argv = [
            "--shape", name, "--modes", mode, "--configs" if mode == "draft" else "--full-configs", spec,
            "--no-isolate", "--out", str(out), "--batch-size", str(args.batch_size), "--block-size",
            str(args.block_size), "--draft-layers", str(args.draft_layers), "--warmup", str(args.warmup),
            "--steps", str(args.steps),
        ]
        optional = {"--seq-len": args.seq_len, "--num-anchors": args.num_anchors, "--dtype": args.dtype,
                    "--matmul-size": args.matmul_size, "--profile": args.profile}
        argv += [x for flag, value in optional.items() if value is not None for x in (flag, str(value))]
        argv += ["--trainer-loop"] if args.trainer_loop else []
        done = subprocess.run([sys.executable, __file__, *argv], check=False)
        rows = json.loads(out.read_text())["results"] if out.exists() else []
    if rows:
        return rows[0]
    return {"shape": name, "mode": mode, "config": spec, "error": f"case process exited {done.returncode}"}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["qwen3-1.7b", "qwen3-8b"], choices=sorted(SHAPES))
    p.add_argument("--tiny", action="store_true", help="CPU regression run: tiny shape, fp32, sdpa configs.")
    p.add_argument("--modes", nargs="+", default=["draft", "full"], choices=["draft", "full"])
    p.add_argument("--configs", nargs="+", default=None, help="e.g. attn=flex,ce=2048,ckpt=0,compile=none")
    p.add_argument("--full-configs", nargs="+", default=None, help="configs for mode full (default: the first)")
    p.add_argument("--seq-len", type=int, default=None, help="default: per shape (1024 for 1.7B, 3072 for 8B)")
    p.add_argument("--num-anchors", type=int, default=None, help="default: per shape (256 for 1.7B, 512 for 8B)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--matmul-size", type=int, default=None, help="n of the n^3 ceiling matmul (8192 on CUDA)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    p.add_argument(
        "--trainer-loop", action="store_true",
        help="also time Trainer.train() on the same batch (CUDA: and list where its steps synchronize)",
    )
    p.add_argument("--no-isolate", action="store_true", help="CUDA: run every case in this process (default: "
                   "one fresh process per case, so compiled state of one case cannot affect the next)")
    p.add_argument("--profile", default=None, help="CUDA: write a torch.profiler operator table per case here")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.tiny:
        args.shape = ["tiny"]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    configs = args.configs or list(GPU_CONFIGS if device.type == "cuda" else CPU_CONFIGS)
    full_configs = args.full_configs or configs[:1]
    n = args.matmul_size or (8192 if device.type == "cuda" else 256)
    ceiling = matmul_tflops(n, dtype, device)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "matmul_size": n,
        "matmul_tflops": round(ceiling, 4),
        "results": [],
    }
    print(f"matmul {n}^3 {report['dtype']}: {ceiling:.1f} TFLOP/s", flush=True)
    isolate = device.type == "cuda" and not args.no_isolate
    for name in args.shape:
        shape = SHAPES[name]
        tmodel = None if isolate else build_target(shape, dtype, device)
        for mode in args.modes:
            for spec in configs if mode == "draft" else full_configs:
                if isolate:
                    row = run_isolated(args, name, mode, spec)
                else:
                    try:
                        row = run_case(name, shape, tmodel, mode, spec, args, device, dtype, ceiling)
                    except Exception as exc:  # one failing variant (e.g. a compile error) must not lose the others
                        row = {"shape": name, "mode": mode, "config": spec, "error": f"{type(exc).__name__}: {exc}"}
                report["results"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "flops"}), flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(report, indent=1))
        del tmodel
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'shape':<11} {'mode':<5} {'config':<36} {'ms':>8} {'TFLOP/s':>8} {'MFU':>6} {'pipe ms':>8} "
          f"{'MFU':>6} {'peak GiB':>8}")
    for r in report["results"]:
        if "error" in r:
            print(f"{r['shape']:<11} {r['mode']:<5} {r['config']:<36} ERROR {r['error'][:80]}")
        else:
            print(
                f"{r['shape']:<11} {r['mode']:<5} {r['config']:<36} {r['ms_per_step']:>8.2f} {r['tflops']:>8.1f} "
                f"{r['mfu']:>6.1%} {r['ms_pipelined']:>8.2f} {r['mfu_pipelined']:>6.1%} {r['peak_gib']:>8.2f}"
            )
    return report


if __name__ == "__main__":
    main()
