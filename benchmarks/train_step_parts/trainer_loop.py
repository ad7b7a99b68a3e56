"""`--trainer-loop`: `Trainer.train()` on the benchmark's batches, timed, and where its steps synchronize."""

from __future__ import annotations

import itertools
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from transformers import (
    TrainerCallback,
)

from dflash_hf.training.trainer import DFlashTrainer
from dflash_hf.training.training_args import DFlashTrainingArguments

from .timing import sync_device


class LoopTimer(TrainerCallback):
    """Wall time of the optimizer steps after `warmup` ones, as `Trainer.train` runs them (the device is drained
    once at the start and once at the end of the timed span, nowhere else)."""

    def __init__(self, warmup: int):
        self.warmup, self.start, self.end, self.steps = warmup, None, None, 0

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            sync_device(args.device)
            self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.start is not None:
            self.steps += 1

    def on_train_end(self, args, state, control, **kwargs):
        sync_device(args.device)
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


def _clone(batch: dict) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}


def _train_on(trainer: DFlashTrainer, batches: list[dict], steps: int, callback: TrainerCallback) -> None:
    """`trainer.train()` for `steps` optimizer steps on `batches` in turn (the collator hands out the CPU batches;
    the Trainer moves them, plans anchors, clips, steps AdamW and logs as in a real run)."""
    cycle = itertools.cycle(batches)
    trainer.train_dataset = [0] * steps
    trainer.data_collator = lambda items: _clone(next(cycle))
    trainer.args.max_steps = steps
    trainer.add_callback(callback)
    try:
        trainer.train()
    finally:
        trainer.remove_callback(callback)


def trainer_loop_ms(trainer: DFlashTrainer, batches: list[dict], warmup: int, steps: int) -> float:
    """Milliseconds per optimizer step of `Trainer.train` after `warmup` steps."""
    timer = LoopTimer(warmup)
    _train_on(trainer, batches, warmup + steps, timer)
    return timer.ms_per_step


def _sync_warning_sites(caught) -> dict[str, int]:
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message))
    return dict(sites.most_common())


def sync_sites(trainer: DFlashTrainer, batches: list[dict], steps: int = 3) -> dict[str, int]:
    """Where `Trainer.train` steps synchronize with the device: `file:line` of each synchronizing call site
    (CUDA sync debug mode) in steps 2..`steps`, with counts."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_on(trainer, batches, steps, SyncWatch(1))
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


def make_trainer(
    target,
    draft,
    config: dict,
    mode: str,
    num_anchors: int,
    out_dir: str,
    *,
    packing_max_tokens: int | None = None,
    compile_target: bool = False,
    target_cuda_graph: bool | None = None,
) -> DFlashTrainer:
    args = DFlashTrainingArguments(
        packing=packing_max_tokens is not None,
        packing_max_tokens=packing_max_tokens,
        torch_compile_layers=[
            *(["draft"] if config["compile"] == "layers" else []),
            *(["target"] if compile_target else []),
        ],
        target_cuda_graph=target_cuda_graph,
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
        float8_draft_linears=config["fp8"] == "1",
        float8_lm_head=config["fp8lm"] == "1",
        num_anchors=num_anchors,
        label_source="target_argmax" if mode == "full" else "ground_truth",
        use_cpu=target.device.type == "cpu",
        per_device_train_batch_size=1,
        report_to="none",
    )
    return DFlashTrainer(model=draft, args=args, target=target)
