"""One case of `train_step.py` (a shape, a mode, a configuration): built, timed and reported as a JSON row."""

from __future__ import annotations

import itertools
import math
import shutil
import statistics
import tempfile
import traceback
from pathlib import Path

import torch

from dflash_hf.models.configuration_dflash import DFlashConfig
from dflash_hf.models.modeling_dflash import DFlashDraftModel
from dflash_hf.objective.blocks import build_blocks, dense_block_mask
from dflash_hf.objective.losses import MetricSums
from dflash_hf.settings.decode import graph_mode
from dflash_hf.targets.frozen import FrozenTarget

from .batches import make_batches
from .flops import draft_flops, target_flops, target_forward_flops
from .models import FixedTapsTarget, memory_breakdown
from .shapes import parse_config
from .timing import pipelined_ms, profile_steps, time_ms
from .trainer_loop import make_trainer, step_sync_sites, sync_sites, trainer_loop_ms


def _cycle(items: list, warmup: int, steps: int) -> tuple[int, int]:
    """Warm-up and timed step counts rounded up to whole cycles over `items` (each micro-batch timed equally
    often, each shape compiled before timing)."""
    n = len(items)
    return max(warmup, n) if n == 1 else math.ceil(max(warmup, n) / n) * n, math.ceil(steps / n) * n


def run_case(name, shape, tmodel, mode, spec, args, device, dtype, ceiling_tflops) -> dict:
    config = parse_config(spec)
    seq_len = args.seq_len or shape.get("seq_len")
    batch_size = args.batch_size or shape.get("batch_size", 1)
    num_anchors = args.num_anchors or shape["num_anchors"]
    frozen = FrozenTarget(tmodel)  # the decoder's dimensions (text_config) and special ids
    tcfg = frozen.text_config
    dcfg = DFlashConfig.from_target_config(
        tcfg, mask_token_id=frozen.vocab_size - 1, num_hidden_layers=args.draft_layers, block_size=args.block_size
    )
    dcfg.vocab_size = frozen.vocab_size
    torch._dynamo.reset()  # each case compiles from scratch (static shapes), not on top of the previous ones
    torch.manual_seed(0)
    with torch.device(device):
        draft = DFlashDraftModel(dcfg).to(dtype)
    draft.train()
    if config["ckpt"] == "1":
        # transformers >= 5.23 names it activation_checkpointing_enable (the old name warns)
        enable = getattr(draft, "activation_checkpointing_enable", None) or draft.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    items = make_batches(shape, frozen, seq_len, batch_size, dcfg.mask_token_id, seed=1)
    cpu_batches = [b for b, _ in items]
    taps = None
    if mode == "draft":
        width = dcfg.num_taps * dcfg.hidden_size
        taps = {
            tuple(b["input_ids"].shape): torch.randn(*b["input_ids"].shape, width, device=device, dtype=dtype)
            for b in cpu_batches
        }
        target = FixedTapsTarget(tmodel, taps)
    else:
        target = FrozenTarget(tmodel)
    out_dir = tempfile.mkdtemp(prefix="dflash-bench-")
    packing = shape["max_tokens"] if shape.get("packed") else None
    trainer = make_trainer(
        target,
        draft,
        config,
        mode,
        num_anchors,
        out_dir,
        packing_max_tokens=packing,
        compile_target=args.compile_target,
        target_cuda_graph=graph_mode(args.target_cuda_graph, "target-cuda-graph"),
    )
    objective, ft = trainer.objective, trainer.target
    plans = [objective.plan(ft, b, seed=0) for b in cpu_batches]  # the first call pays one-time costs
    plan_ms = statistics.median(time_ms(lambda: objective.plan(ft, cpu_batches[0], seed=0), torch.device("cpu"), 0, 5))
    # get_batch_samples hands the global denominator over on the device
    prepared = [
        ({k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()}, p, p.denominator.to(device))
        for b, p in zip(cpu_batches, plans)
    ]
    optimizer = torch.optim.AdamW(draft.parameters(), lr=6e-4, fused=device.type == "cuda")
    cycle = itertools.cycle(prepared)
    sums = MetricSums()

    def step():  # what DFlashTrainer.compute_loss runs (metric sums included), without the Trainer
        dev_batch, plan, denom = next(cycle)
        out = objective.loss(draft, ft, dev_batch, plan)
        loss, skipped = objective.normalize(out, denom, training_step=True)
        objective.record(sums, out, plan, skipped)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), trainer.args.max_grad_norm)  # as Trainer does
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # FLOPs from the exact blocks and mask of each plan, per step (mean over the cycle).
    per_batch = []
    for plan in plans:
        blocks = build_blocks(
            plan.input_ids,
            plan.input_ids,
            plan.loss_mask,
            plan.doc_ids,
            plan.positions,
            plan.anchors,
            dcfg.block_size,
            dcfg.mask_token_id,
            objective.gamma,
        )
        visible = int(dense_block_mask(plan.anchors, plan.doc_ids, dcfg.block_size).sum())
        rows, width = plan.input_ids.shape
        flops = draft_flops(dcfg, width, rows, plan.anchors.numel(), visible, int(blocks.valid.sum()))
        if mode == "full":
            supervised = int(plan.loss_mask[:, 1:].sum())
            if frozen.family.name == "text":  # closed form (the flop counter rejects SDPA with grouped KV heads)
                flops.update(target_flops(frozen.text_config, width, rows, supervised))
            else:
                dev_batch = prepared[len(per_batch)][0]
                flops["target_forward"] = target_forward_flops(ft, dev_batch, objective.target_layer_ids)
                flops["target_argmax_labels"] = 2 * supervised * frozen.hidden_size * frozen.vocab_size
        per_batch.append((flops, visible, plan.anchors.numel(), rows, width))
    n_items = len(items)
    flops = {k: sum(f[k] for f, *_ in per_batch) // n_items for k in per_batch[0][0]}
    visible = sum(v for _, v, *_ in per_batch) // n_items
    n_blocks = sum(nb for _, _, nb, *_ in per_batch) / n_items
    total = sum(flops.values())
    samples = sum(int(p.doc_ids.amax(-1).add(1).sum()) for p in plans) / n_items  # documents per step
    tokens = sum(int(b["attention_mask"].sum()) for b in cpu_batches) / n_items  # real decoder tokens per step
    audio_s = sum(a for _, a in items) / n_items

    target_side = {}
    if mode == "full":  # the target's forward alone (taps, final states), as the step runs it

        def forward():
            dev_batch, plan, _ = next(cycle)
            ft.capture(
                dev_batch, objective.target_layer_ids, keep_final=True, padded=plan.padded, host=plan.target_host
            )

        forward_ms = time_ms(forward, device, *_cycle(items, 2 * len(items), 5))  # captured in the warm-up
        target_side = {"target_forward_ms": round(statistics.median(forward_ms), 3)}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    static = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    warmup, steps = _cycle(items, args.warmup, args.steps)
    times = time_ms(step, device, warmup, steps)
    ms, mean_ms = statistics.median(times), statistics.fmean(times)
    pipelined = pipelined_ms(step, device, steps)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    # a CUDA graph's pool is reserved, not allocated, while it replays: the reserved peak counts it
    peak_reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
    loop = {}
    if args.trainer_loop:
        loop_ms = trainer_loop_ms(trainer, cpu_batches, warmup, steps)
        loop_mfu = total / (loop_ms * 1e-3) / 1e12 / ceiling_tflops
        loop = {"ms_trainer_loop": round(loop_ms, 3), "mfu_trainer_loop": round(loop_mfu, 4)}
        if device.type == "cuda":
            loop["trainer_sync_sites"] = sync_sites(trainer, cpu_batches)
    profiled = {}
    if args.profile and device.type == "cuda":
        tag = f"{name}_{mode}_{spec}".replace(",", "_").replace("=", "-")
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        profiled = profile_steps(step, 3, Path(args.profile) / f"{tag}.txt")
        profiled["step_sync_sites"] = step_sync_sites(step)
    shutil.rmtree(out_dir, ignore_errors=True)
    tflops = total / (ms * 1e-3) / 1e12
    speech = {}
    if audio_s:
        speech = {
            "audio_s_per_step": round(audio_s, 2),
            # audio seconds trained per second of step time = audio hours per GPU-hour
            "audio_hours_per_gpu_hour": round(audio_s / (mean_ms * 1e-3), 1),
            "audio_hours_per_gpu_hour_pipelined": round(audio_s / (pipelined * 1e-3), 1),
            "micro_batches": [{"rows": r, "width": w, "blocks": nb} for _, _, nb, r, w in per_batch],
        }
    return {
        "shape": name,
        "mode": mode,
        "config": spec,
        "compile_target": args.compile_target,
        "target_cuda_graph": args.target_cuda_graph,
        "target_graph_replays": None if ft.forward_graphs is None else ft.forward_graphs.replays,
        **target_side,
        "seq_len": round(sum(w for *_, w in per_batch) / n_items, 1) if n_items > 1 else per_batch[0][4],
        "batch_size": round(sum(r for *_, r, _ in per_batch) / n_items, 1) if n_items > 1 else per_batch[0][3],
        "num_anchors": num_anchors,
        "block_size": args.block_size,
        "draft_layers": args.draft_layers,
        "blocks": round(n_blocks, 1) if n_items > 1 else int(n_blocks),
        "visible_pairs": visible,
        "ms_per_step": round(ms, 3),
        "ms_mean": round(mean_ms, 3),
        "ms_min": round(min(times), 3),
        "ms_max": round(max(times), 3),
        "ms_pipelined": round(pipelined, 3),
        "mfu_pipelined": round(total / (pipelined * 1e-3) / 1e12 / ceiling_tflops, 4),
        **loop,
        **profiled,
        "plan_ms": round(plan_ms, 3),
        "samples_per_step": samples,
        "samples_per_s": round(samples / (mean_ms * 1e-3), 1),
        "tokens_per_s": round(tokens / (ms * 1e-3), 1),
        "block_tokens_per_s": round(n_blocks * args.block_size / (ms * 1e-3), 1),
        **speech,
        "model_tflop_per_step": round(total / 1e12, 6),
        "matmul_tflops": round(ceiling_tflops, 4),
        "flops": flops,
        "tflops": round(tflops, 4),
        "mfu": round(tflops / ceiling_tflops, 4),
        "static_gib": round(static / 2**30, 3),
        "peak_gib": round(peak / 2**30, 3),
        "peak_reserved_gib": round(peak_reserved / 2**30, 3),
        "memory_gib": memory_breakdown(tmodel, ft, draft, optimizer, mode, taps, peak / 2**30),
    }


def traceback_tail(exc: BaseException, lines: int = 40) -> list[str]:
    """The last lines of a failed case's formatted traceback (an InductorError's message can be empty; the frames
    above it say where it came from), for the JSON row."""
    return "".join(traceback.format_exception(exc)).splitlines()[-lines:]
