"""``train``: the projector (and LoRA) trained to transcribe, within a step or time budget."""

from __future__ import annotations

import contextlib
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from quality_steps.common import SAMPLING_RATE, tqdm, write_json

from .data import encode_row, encode_training_batch, load_audio, pad_batch, pad_id_of, read_manifest, render
from .modeling import add_lora, encode_audio, forward_with_audio, merge_lora, save_target, supervised_loss
from .presets import INSTRUCTION

PROBE_STEPS = 20  # steps timed before --max_minutes shortens the schedule
REPLAN_EVERY = 50  # then the horizon is re-planned every this many steps from the rate since the probe


def planned_horizon(step: int, steps: int, elapsed: float, budget: float, probe: tuple[int, float] | None) -> int:
    """Steps that fit in `budget` seconds (at most `steps`, more than `step`): from the first steps' rate at the
    probe, then from the rate measured since the probe (the first steps pay warm-up and were slower on a shared
    GPU: planning from them alone ended a run at half its budget)."""
    if probe is None:
        rate = elapsed / max(step, 1)
    else:
        rate = (time.time() - probe[1]) / max(step - probe[0], 1)
    fit = step + int(max(budget - elapsed, 0.0) / max(rate, 1e-9))
    return max(step + 1, min(steps, fit))


class AudioCache:
    """Tower outputs per audio file, computed once per process (the encoder is frozen)."""

    def __init__(self, model, processor, batch_size: int):
        self.model, self.processor, self.batch_size = model, processor, batch_size
        self.frames: dict[str, torch.Tensor] = {}
        self.audio: dict[str, np.ndarray] = {}

    @torch.no_grad()
    def fill(self, rows: list[dict], autocast=None, desc: str = "encoder") -> None:
        """Tower outputs of every new audio file; ``autocast`` (a context) wraps the tower only: the feature
        extractor must run in fp32 (its numpy conversion refuses bf16)."""
        todo = list({r["audio_filepath"]: r for r in rows if r["audio_filepath"] not in self.frames}.values())
        for i in tqdm(range(0, len(todo), self.batch_size), desc=desc, unit="batch", disable=not todo):
            chunk = todo[i : i + self.batch_size]
            audios = [self.get_audio(r) for r in chunk]
            feats = self.processor.feature_extractor(
                audios,
                sampling_rate=SAMPLING_RATE,
                padding="max_length",
                return_attention_mask=True,
                return_tensors="pt",
                device=str(self.model.device),
            )
            with autocast or contextlib.nullcontext():
                frames = encode_audio(self.model, feats["input_features"], feats["attention_mask"])
            for r, h in zip(chunk, frames):
                self.frames[r["audio_filepath"]] = h.detach()

    def of(self, rows: list[dict]) -> list[torch.Tensor]:
        return [self.frames[r["audio_filepath"]] for r in rows]

    def get_audio(self, row: dict) -> np.ndarray:
        path = row["audio_filepath"]
        if path not in self.audio:
            self.audio[path] = load_audio(path)
        return self.audio[path]


def train(
    model_dir: Path,
    manifest: Path,
    out: Path,
    steps: int = 2000,
    batch_size: int = 32,
    lr: float = 1e-3,
    lora_rank: int = 16,
    lora_lr: float | None = None,
    device: str = "auto",
    precision: str = "bf16",
    warmup: int = 30,
    seed: int = 0,
    instruction: str = INSTRUCTION,
    encoder_batch_size: int = 32,
    log_every: int = 10,
    max_minutes: float | None = None,
) -> Path:
    """Train the projector (+ LoRA, merged) on transcription; saves a Qwen2-Audio checkpoint and its recipe.
    ``max_minutes`` stops the optimisation early (recorded) to keep a time budget."""
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from dflash_hf.export.evaluation_setup import evaluation_device
    from dflash_hf.targets.families.registry import resolve_family

    if (out / "recipe.json").is_file() and (out / "config.json").is_file():
        print(f"{out} is trained (recipe.json exists); delete it to retrain")
        return out
    for name, value in (("--steps", steps), ("--batch_size", batch_size), ("--encoder_batch_size", encoder_batch_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if lora_rank < 0:
        raise ValueError(f"--lora_rank must be >= 0 (0 = projector only), got {lora_rank}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"--precision must be fp32 or bf16, got {precision!r}")
    rows = read_manifest(manifest)
    if batch_size > len(rows):
        raise ValueError(f"--batch_size {batch_size} exceeds the {len(rows)} clips of --train {manifest}; lower it")
    device = str(evaluation_device(device))
    torch.manual_seed(seed)
    random.seed(seed)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).to(device)
    processor = AutoProcessor.from_pretrained(model_dir)
    family = resolve_family(model.config, "qwen2_audio")
    model.requires_grad_(False)
    model.model.multi_modal_projector.requires_grad_(True)
    if lora_rank:
        add_lora(model, lora_rank)
    params = [{"params": list(model.model.multi_modal_projector.parameters()), "lr": lr}]
    lora = [p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]
    if lora:
        params.append({"params": lora, "lr": lora_lr or lr / 5})
    opt = torch.optim.AdamW(params, weight_decay=0.0)
    horizon = {"steps": steps}  # shortened once the step time is known when --max_minutes would cut the run
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, horizon["steps"]) / horizon["steps"]))
        ),
    )
    model.eval()  # no dropout anywhere; grads still flow to the projector / LoRA
    autocast = torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=precision == "bf16")

    start = time.time()
    cache = AudioCache(model, processor, encoder_batch_size)
    cache.fill(rows, autocast)
    encode_seconds = time.time() - start
    check_cached_forward(model, processor, family, rows[:2], cache, instruction)
    examples = [
        encode_row(processor, r, len(f), instruction)  # rendered once: the text side is fixed too
        for r, f in zip(tqdm(rows, desc="tokenize", unit="clip"), cache.of(rows))
    ]
    pad_id = pad_id_of(processor.tokenizer)
    curve, order, pos = [], [], 0
    bar = tqdm(range(steps), desc="train", unit="step")
    t0 = time.time()
    done = 0
    probe = None  # (step, time) after the first PROBE_STEPS: the rate is measured from there, past the warm-up
    for step in bar:
        if step >= horizon["steps"]:
            break
        if max_minutes is not None and time.time() - t0 > 60 * max_minutes:
            print(f"--max_minutes {max_minutes} reached after {step} steps")
            break
        if max_minutes is not None and step >= PROBE_STEPS and (step - PROBE_STEPS) % REPLAN_EVERY == 0:
            horizon["steps"] = planned_horizon(step, steps, time.time() - t0, 60 * max_minutes, probe)
            bar.total = horizon["steps"]
            if step == PROBE_STEPS:
                probe = (step, time.time())
                print(
                    f"--max_minutes {max_minutes}: about {horizon['steps']} of {steps} steps fit (re-planned every "
                    f"{REPLAN_EVERY} steps); the cosine ends there"
                )
        if pos + batch_size > len(order):
            order, pos = random.sample(range(len(rows)), len(rows)), 0
        idx = order[pos : pos + batch_size]
        chunk = [rows[i] for i in idx]
        pos += batch_size
        batch = pad_batch([examples[i] for i in idx], pad_id)
        with autocast:
            loss = supervised_loss(
                model,
                batch["input_ids"].to(device),
                batch["attention_mask"].to(device),
                cache.of(chunk),
                batch["labels"],
            )
        if not torch.isfinite(loss):  # nothing diverged is saved: the weights would be NaN from here on
            raise RuntimeError(diverged("loss", loss.item(), step + 1, chunk, lr))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_([p for g in params for p in g["params"]], 1.0)
        if not torch.isfinite(norm):  # caught before the update: the batch that broke it, not the one after
            raise RuntimeError(diverged("gradient norm", norm.item(), step + 1, chunk, lr, loss=loss.item()))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == horizon["steps"] - 1:
            curve.append({"step": step + 1, "loss": round(loss.item(), 4), "seconds": round(time.time() - t0, 1)})
            bar.set_postfix(loss=f"{loss.item():.3f}")
        done = step + 1
    train_seconds = time.time() - t0
    merge_lora(model)
    model.requires_grad_(False)
    save_target(model.to("cpu"), processor, out)
    recipe = {
        "model": str(model_dir),
        "train_manifest": str(manifest),
        "clips": len(rows),
        "steps": done,
        "steps_planned": steps,
        "steps_scheduled": horizon["steps"],
        "max_minutes": max_minutes,
        "batch_size": batch_size,
        "lr": lr,
        "lora_rank": lora_rank,
        "lora_lr": (lora_lr or lr / 5) if lora else None,
        "warmup": warmup,
        "schedule": "linear warmup + cosine",
        "precision": precision,
        "device": device,
        "instruction": instruction,
        "seed": seed,
        "encoder_seconds": round(encode_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "seconds_per_step": round(train_seconds / max(done, 1), 3),
        "loss_curve": curve,
    }
    write_json(out / "recipe.json", recipe)
    print(f"saved {out}; loss {curve[0]['loss']} -> {curve[-1]['loss']} in {train_seconds:.0f} s")
    return out


@torch.no_grad()
def diverged(what: str, value: float, step: int, chunk: list[dict], lr: float, loss: float | None = None) -> str:
    """The message of a non-finite `what` (the loss, the gradient norm) at `step` (1-based): that step's loss when
    given, its batch's first clips, and the fix."""
    finite_loss = "" if loss is None else f"loss {loss:.4f}; "
    return (
        f"the {what} is {value} at step {step} ({finite_loss}clips {', '.join(r['id'] for r in chunk[:4])}, ...): "
        f"training diverged, nothing was saved. Lower --lr (now {lr}) and --lora_lr, or train in fp32 "
        "(--precision fp32)"
    )


def check_cached_forward(model, processor, family, rows, cache, instruction) -> None:
    """The training path (own placeholder expansion, tower outputs from :func:`encode_audio`, projector scattered
    into the embeddings) must give the ids of dflash_hf's processor call and the model's own logits, in fp32 on
    the same features: guards the path on any transformers version before training starts."""
    from dflash_hf.targets.families.registry import encode_batch

    full = [render(processor, r["text"], instruction)[0] for r in rows]
    ref = encode_batch(family, processor, model.config, full, [cache.get_audio(r) for r in rows], "right")
    frames = encode_audio(model, ref["input_features"], ref["feature_attention_mask"])
    mine = encode_training_batch(processor, rows, [len(f) for f in frames], instruction)
    if not torch.equal(mine["input_ids"], ref["input_ids"]):
        raise RuntimeError("the training batch's ids differ from the processor's (audio expansion mismatch)")
    dev = model.device
    logits = forward_with_audio(model, mine["input_ids"].to(dev), mine["attention_mask"].to(dev), frames)
    want = model(**{k: v.to(dev) for k, v in ref.items()}).logits
    keep = mine["attention_mask"].bool().to(dev)
    err = (logits[keep].float() - want[keep].float()).abs().max().item()
    scale = want[keep].float().abs().max().item()
    if err > 1e-3 * scale + 1e-4:
        raise RuntimeError(
            f"cached-encoder forward differs from the model's forward (max |diff| {err:.3g}, "
            f"logit scale {scale:.3g}); the training path does not match this transformers version"
        )
