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

    python benchmarks/train_step.py --shape qwen3-8b --out results.json
    python benchmarks/train_step.py --tiny --out tiny.json   # CPU regression run
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3ASRConfig,
    Qwen3ASRForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    TrainerCallback,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_hf.data.packing import pack_padded_batch  # noqa: E402
from dflash_hf.models.configuration_dflash import DFlashConfig  # noqa: E402
from dflash_hf.models.modeling_dflash import DFlashDraftModel  # noqa: E402
from dflash_hf.objective.blocks import build_blocks, dense_block_mask  # noqa: E402
from dflash_hf.objective.losses import MetricSums  # noqa: E402
from dflash_hf.settings.decode import graph_mode  # noqa: E402
from dflash_hf.targets.families.base import SAMPLING_RATE  # noqa: E402
from dflash_hf.targets.families.registry import FAMILIES  # noqa: E402
from dflash_hf.targets.families.whisper_features import AUDIO_WAVES_KEY, padded_waves, standard_extractor  # noqa: E402
from dflash_hf.targets.frozen import FrozenTarget, TargetFeatures  # noqa: E402
from dflash_hf.training.trainer import DFlashTrainer  # noqa: E402
from dflash_hf.training.training_args import DFlashTrainingArguments  # noqa: E402

# The real targets of the quality benchmark (their checkpoints' config.json, trimmed to the fields that shape the
# model), built with random weights.
WHISPER_BASE = dict(
    vocab_size=51865,
    num_mel_bins=80,
    d_model=512,
    encoder_layers=6,
    encoder_attention_heads=8,
    encoder_ffn_dim=2048,
    decoder_layers=6,
    decoder_attention_heads=8,
    decoder_ffn_dim=2048,
    max_source_positions=1500,
    max_target_positions=448,
    activation_function="gelu",
    scale_embedding=False,
    pad_token_id=50257,
    bos_token_id=50257,
    eos_token_id=50257,
    decoder_start_token_id=50258,
    tie_word_embeddings=True,
)
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    hidden_act="silu",
    max_position_embeddings=8192,
    rms_norm_eps=9.999999747378752e-06,
    rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
# Qwen3-ASR-1.7B-shaped: transformers' Qwen3-ASR audio encoder (24 layers, d_model 1024, 128 mel bins, 100-frame
# chunks) projecting to a Qwen3-1.7B decoder.
QWEN3_1_7B_TEXT = dict(
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=65536,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    pad_token_id=151645,
    eos_token_id=151645,
)
QWEN3_ASR_1_7B = dict(
    audio_config=dict(
        model_type="qwen3_asr_encoder",
        num_mel_bins=128,
        encoder_layers=24,
        encoder_attention_heads=16,
        encoder_ffn_dim=4096,
        d_model=1024,
        output_dim=2048,
        n_window=50,
        n_window_infer=800,
        downsample_hidden_size=480,
        max_position_embeddings=13,
    ),
    text_config=QWEN3_1_7B_TEXT,
    audio_token_id=151676,
    pad_token_id=151645,
    eos_token_id=151645,
    tie_word_embeddings=True,
)
# CPU-sized versions of the same architectures (`--tiny` with `--shape tiny-...`): the GPU rows' code path.
TINY_WHISPER = dict(
    WHISPER_BASE,
    vocab_size=600,
    d_model=64,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_layers=4,
    decoder_attention_heads=4,
    decoder_ffn_dim=128,
    num_mel_bins=16,
    max_source_positions=50,
    pad_token_id=500,
    bos_token_id=500,
    eos_token_id=500,
    decoder_start_token_id=501,
)
TINY_LLAMA = dict(
    SMOLLM2_135M,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
TINY_QWEN3_ASR = dict(
    audio_config=dict(
        QWEN3_ASR_1_7B["audio_config"],
        num_mel_bins=16,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        d_model=32,
        output_dim=64,
        n_window_infer=100,
        downsample_hidden_size=8,
    ),
    text_config=dict(
        QWEN3_1_7B_TEXT,
        vocab_size=600,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=510,
        eos_token_id=510,
    ),
    audio_token_id=520,
    pad_token_id=510,
    eos_token_id=510,
    tie_word_embeddings=True,
)
# Speech rows: `durations` of the utterances (s, uniform). Whisper: `batch_size` utterances, each on 30 s of padded
# features (one encoder window), decoder rows of `tokens` (4 prompt tokens, unsupervised, then the transcript).
# Qwen3-ASR: `num_batches` micro-batches cycled through the timed steps, each filled up to `max_tokens` decoder
# positions: padded with duration bucketing (batch k holds utterances of the k-th duration bucket) or packed
# (utterances of any duration back to back in one row).
_WHISPER_ROWS = dict(durations=(5.0, 20.0), tokens=(20, 40), num_anchors=16)
_ASR_ROWS = dict(durations=(5.0, 20.0), num_batches=4, max_tokens=8192, num_anchors=32, tokens_per_second=3.0)
_TINY_ASR_ROWS = dict(_ASR_ROWS, durations=(0.5, 2.0), max_tokens=384, num_anchors=8, tokens_per_second=6.0)
_QWEN3_1_7B = dict(
    hidden_size=2048,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=6144,
    vocab_size=151936,
)
SHAPES = {
    "qwen3-1.7b": dict(_QWEN3_1_7B, seq_len=1024, num_anchors=256),
    # the "speech-like" text row: 64 rows of 256 tokens (the first eighth prompt), 40 anchors a row
    "qwen3-1.7b-speechlike": dict(_QWEN3_1_7B, seq_len=256, num_anchors=40, batch_size=64),
    "qwen3-8b": dict(
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        seq_len=3072,
        num_anchors=512,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        seq_len=96,
        num_anchors=16,
    ),
    "smollm2-135m": dict(kind="llama", config=SMOLLM2_135M, seq_len=1024, num_anchors=256, batch_size=8),
    "whisper-base": dict(kind="whisper", config=WHISPER_BASE, batch_size=64, **_WHISPER_ROWS),
    "qwen3-asr-1.7b": dict(kind="qwen3_asr", config=QWEN3_ASR_1_7B, packed=False, **_ASR_ROWS),
    "qwen3-asr-1.7b-packed": dict(kind="qwen3_asr", config=QWEN3_ASR_1_7B, packed=True, **_ASR_ROWS),
    "tiny-smollm2": dict(kind="llama", config=TINY_LLAMA, seq_len=96, num_anchors=16, batch_size=2),
    "tiny-whisper": dict(
        kind="whisper", config=TINY_WHISPER, batch_size=6, durations=(0.2, 1.0), tokens=(12, 24), num_anchors=4
    ),
    "tiny-qwen3-asr": dict(kind="qwen3_asr", config=TINY_QWEN3_ASR, packed=False, **_TINY_ASR_ROWS),
    "tiny-qwen3-asr-packed": dict(kind="qwen3_asr", config=TINY_QWEN3_ASR, packed=True, **_TINY_ASR_ROWS),
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
CONFIG_DEFAULTS = {"attn": "flex", "ce": "2048", "ckpt": "0", "compile": "none", "fp8": "0", "fp8lm": "0"}


def parse_config(spec: str) -> dict:
    """`attn=flex,ce=2048,ckpt=0,compile=none,fp8=0,fp8lm=0` -> dict (missing keys take CONFIG_DEFAULTS; `fp8=1`:
    `float8_draft_linears`, `fp8lm=1`: `float8_lm_head`)."""
    cfg = dict(CONFIG_DEFAULTS)
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in CONFIG_DEFAULTS:
            raise ValueError(f"bad config item {item!r} in {spec!r}; keys: {sorted(CONFIG_DEFAULTS)}")
        cfg[key] = value
    if (
        cfg["attn"] not in ("flex", "sdpa")
        or cfg["compile"] not in ("none", "layers")
        or {cfg["fp8"], cfg["fp8lm"]} - {"0", "1"}
    ):
        raise ValueError(f"bad config {spec!r}: attn is flex|sdpa, compile is none|layers, fp8 and fp8lm are 0|1")
    return cfg


class FixedTapsTarget(FrozenTarget):
    """The frozen target with its forward replaced by fixed random taps (one tensor per decoder-stream shape,
    made before timing): times the draft side alone."""

    def __init__(self, model, taps: dict[tuple[int, int], torch.Tensor]):
        super().__init__(model)
        self.taps = taps

    def capture(self, batch, layer_ids, keep_final=False, padded=None, host=None) -> TargetFeatures:
        return TargetFeatures(taps=self.taps[tuple(batch["input_ids"].shape)], final_hidden=None)


def _gib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**30


def memory_breakdown(tmodel, ft: FrozenTarget, draft, optimizer, mode: str, taps: dict | None, peak: float) -> dict:
    """What the peak holds (GiB), from the sizes of the tensors themselves: the frozen target's decoder layers and
    its other weights (embeddings, lm_head, audio encoder), the draft's weights, gradients (one per trainable
    weight) and optimizer states, the fixed taps of the draft side, and the rest of the peak (activations,
    temporaries, workspaces; CUDA only). The draft side never runs the target's decoder layers:
    `draft_side_peak_without_target_layers` is the peak a trainer holding only what the draft side uses would see."""
    layers = _gib(p for layer in ft.layers for p in layer.parameters())
    target = _gib(tmodel.parameters())
    draft_w = _gib(draft.parameters())
    grads = _gib(p for p in draft.parameters() if p.requires_grad)
    states = _gib(v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    taps_gib = _gib(taps.values()) if taps else 0.0
    out = {
        "target_decoder_layers": layers,
        "target_other": target - layers,
        "draft_weights": draft_w,
        "draft_grads": grads,
        "optimizer_states": states,
        "fixed_taps": taps_gib,
    }
    if peak:
        out["activations_and_rest"] = peak - sum(out.values())
        if mode == "draft":
            out["draft_side_peak_without_target_layers"] = peak - layers
    return {k: round(v, 6) for k, v in out.items()}


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
    tables = [
        events.table(sort_by=key, row_limit=50, max_name_column_width=90)
        for key in ("self_device_time_total", "cpu_time_total")
    ]
    path.write_text("\n\n".join(tables))
    return {
        "profiled_wall_ms": round(wall, 3),
        "device_busy_ms": round(device_busy_us(events) / 1e3 / steps, 3),
        "host_waits": host_waits(prof.events()),
    }


def device_busy_us(events) -> float:
    """Microseconds the GPU spent in kernels (and copies) among a profile's `key_averages()`."""
    return sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)


def host_waits(events) -> dict[str, dict]:
    """Every host wait for the device inside the profiled steps (`cudaStreamSynchronize`, `cudaEventSynchronize`,
    `cudaDeviceSynchronize`): its operator chain, innermost Python frames and the top-level operator that ran
    just before it on the same thread (the site when no Python frame is recorded), with count and total ms.
    This finds waits that the CUDA sync debug mode does not flag."""
    top = sorted(
        (e for e in events if e.cpu_parent is None and e.device_type == torch.autograd.DeviceType.CPU),
        key=lambda e: e.time_range.start,
    )
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


def target_flops(tcfg, seq_len: int, batch: int, supervised: int) -> dict:
    """Model FLOPs of a decoder-only text target's forward (causal attention) and of the target_argmax labels."""
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
def _random_init(cls, config, dtype: torch.dtype, device: torch.device):
    """`cls(config)` with random weights, built directly in `dtype` on `device`, frozen (eval, no grad)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def build_target(shape: dict, dtype: torch.dtype, device: torch.device):
    """The frozen target of `shape` with random weights (sdpa attention, as training loads it)."""
    kind = shape.get("kind", "qwen3")
    if kind == "qwen3":
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
        return _random_init(Qwen3ForCausalLM, tcfg, dtype, device)
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "whisper": (WhisperConfig, WhisperForConditionalGeneration),
        "qwen3_asr": (Qwen3ASRConfig, Qwen3ASRForConditionalGeneration),
    }[kind]
    return _random_init(model_cls, config_cls(**shape["config"], attn_implementation="sdpa"), dtype, device)


def _text_id_limit(target: FrozenTarget, mask_token_id: int) -> int:
    """Random text ids are drawn below this: no special id (pad, eos, audio placeholder) and no mask id."""
    cfg = target.model.config
    specials = [i for ids in target.special_ids().values() for i in ids]
    specials += [
        v for v in (getattr(cfg, "audio_token_id", None), getattr(cfg, "decoder_start_token_id", None)) if v is not None
    ]
    return min([mask_token_id, *(i for i in specials if i >= 3)])  # ids below 3 are never drawn


def make_batch(shape: dict, seq_len: int, batch: int, mask_token_id: int, seed: int, low: int = 2) -> dict:
    """Random ids in `[low, mask_token_id)`; the first eighth of each row is the unsupervised prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, mask_token_id, (batch, seq_len), generator=g)
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    loss_mask[:, seq_len // 8 :] = True
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


def _padded_rows(rows: list[tuple[list[int], list[bool]]], pad_id: int) -> dict:
    """Right-padded `input_ids` / `attention_mask` / `loss_mask` of (ids, supervised) rows."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    am = torch.zeros_like(ids)
    lm = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, (row_ids, sup) in enumerate(rows):
        ids[r, : len(row_ids)] = torch.tensor(row_ids)
        am[r, : len(row_ids)] = 1
        lm[r, : len(row_ids)] = torch.tensor(sup)
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm}


def whisper_batch(shape: dict, target: FrozenTarget, n: int, mask_token_id: int, g: torch.Generator):
    """`n` utterances of `durations` seconds: padded waves as the trainer's loader gives them (random samples up to
    the longest utterance's frames; the step computes their log-mel and the 30 s window on the device),
    decoder rows of `tokens` tokens (longer for longer audio): the 4-token prompt (start of transcript and 3 prompt
    ids, unsupervised), the transcript and the end token (supervised)."""
    cfg = target.model.config
    (lo_s, hi_s), (lo_t, hi_t) = shape["durations"], shape["tokens"]
    durations = (lo_s + (hi_s - lo_s) * torch.rand(n, generator=g)).tolist()
    limit = _text_id_limit(target, mask_token_id)
    rows = []
    for d in durations:
        length = round(lo_t + (d - lo_s) / (hi_s - lo_s) * (hi_t - lo_t))
        text = torch.randint(3, limit, (length - 2,), generator=g).tolist()
        ids = [cfg.decoder_start_token_id, *text, cfg.eos_token_id]
        rows.append((ids, [False] * 4 + [True] * (length - 4)))
    batch = _padded_rows(rows, cfg.pad_token_id)
    extractor = standard_extractor(cfg.num_mel_bins, 2 * cfg.max_source_positions)
    audios = [(0.1 * torch.randn(round(d * SAMPLING_RATE), generator=g)).numpy() for d in durations]
    batch[AUDIO_WAVES_KEY] = torch.from_numpy(padded_waves(extractor, audios, SAMPLING_RATE))
    return batch, sum(durations)  # (batch, audio seconds)


def qwen3_asr_batches(shape: dict, target: FrozenTarget, mask_token_id: int, g: torch.Generator):
    """`num_batches` micro-batches of utterances of `durations` seconds, each filled up to `max_tokens` decoder
    positions. A row is an 8-token prompt, one `audio_token_id` per encoder frame (the processor's expansion),
    4 tokens, then the transcript (`tokens_per_second`) and the end token (supervised). Padded: batch k takes
    durations of the k-th of `num_batches` equal duration buckets, rows until the padded batch would exceed
    `max_tokens`; packed: durations of the whole range back to back in one row (`pack_padded_batch`, what the
    packing collator runs). Features: random mel values, the mask covering each utterance's frames, padded to
    whole 100-frame chunks. Returns `[(batch, audio seconds)]`."""
    cfg = target.model.config
    family = FAMILIES["qwen3_asr"]
    lo, hi = shape["durations"]
    k = shape["num_batches"]
    limit = _text_id_limit(target, mask_token_id)
    chunk = 2 * cfg.audio_config.n_window
    out = []
    for b in range(k):
        span = (lo + (hi - lo) * b / k, lo + (hi - lo) * (b + 1) / k) if not shape["packed"] else (lo, hi)
        rows, durations = [], []
        while True:
            d = span[0] + (span[1] - span[0]) * float(torch.rand((), generator=g))
            samples = int(d * family.sampling_rate)
            n_text = round(shape["tokens_per_second"] * d)
            ids = (
                torch.randint(3, limit, (8,), generator=g).tolist()
                + [cfg.audio_token_id] * family.audio_tokens(cfg, samples)
                + torch.randint(3, limit, (4 + n_text,), generator=g).tolist()
                + [cfg.eos_token_id]
            )
            sup = [False] * (len(ids) - n_text - 1) + [True] * (n_text + 1)
            width = max([len(ids), *(len(r[0]) for r in rows)])
            used = sum(len(r[0]) for r in rows) + len(ids) if shape["packed"] else width * (len(rows) + 1)
            if rows and used > shape["max_tokens"]:
                break
            rows.append((ids, sup))
            durations.append(samples)
        batch = _padded_rows(rows, cfg.pad_token_id)
        frames = [max(n, 8000) // 160 for n in durations]  # the feature extractor's frames (clips < 0.5 s padded)
        width = math.ceil(max(frames) / chunk) * chunk
        batch["input_features"] = torch.randn(len(rows), cfg.audio_config.num_mel_bins, width, generator=g)
        batch["input_features_mask"] = (torch.arange(width)[None] < torch.tensor(frames)[:, None]).long()
        if shape["packed"]:
            batch = pack_padded_batch(batch, shape["max_tokens"], pad_token_id=cfg.pad_token_id)
        out.append((batch, sum(durations) / family.sampling_rate))
    return out


def make_batches(shape: dict, target: FrozenTarget, seq_len: int, batch_size: int, mask_token_id: int, seed: int):
    """The micro-batches one timed cycle runs, each with the audio seconds it holds (0 for text)."""
    kind = shape.get("kind", "qwen3")
    g = torch.Generator().manual_seed(seed)
    if kind == "whisper":
        return [whisper_batch(shape, target, batch_size, mask_token_id, g)]
    if kind == "qwen3_asr":
        return qwen3_asr_batches(shape, target, mask_token_id, g)
    low = 2 if kind == "qwen3" else 3  # qwen3 rows: pad 0, eos 1
    return [(make_batch(shape, seq_len, batch_size, _text_id_limit(target, mask_token_id), seed, low), 0.0)]


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


def target_forward_flops(target: FrozenTarget, batch: dict, layer_ids: list[int]) -> int:
    """FLOPs of one tapped target forward as executed (padding and the audio encoder included), counted by
    `torch.utils.flop_counter` (matmuls, convolutions, attention): for targets without a closed-form count.
    Compiled layers (`--compile-target`) run eagerly here: the counter sees every operator, nothing compiles."""
    with torch.compiler.set_stance("force_eager"), FlopCounterMode(display=False) as counter:
        target.features(batch, layer_ids, keep_final=True)  # eager, never a graph's replay
    return counter.get_total_flops()


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
    plan_ms = statistics.median(_time_ms(lambda: objective.plan(ft, cpu_batches[0], seed=0), torch.device("cpu"), 0, 5))
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

        forward_ms = _time_ms(forward, device, *_cycle(items, 2 * len(items), 5))  # captured in the warm-up
        target_side = {"target_forward_ms": round(statistics.median(forward_ms), 3)}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    static = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    warmup, steps = _cycle(items, args.warmup, args.steps)
    times = _time_ms(step, device, warmup, steps)
    ms, mean_ms = statistics.median(times), statistics.fmean(times)
    pipelined = _pipelined_ms(step, device, steps)
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


def run_isolated(args: argparse.Namespace, name: str, mode: str, spec: str) -> dict:
    """One case in a fresh Python process, so that compiled state (dynamo caches and recompile counts) cannot leak
    from one case into the next. Its MFU is against the matmul ceiling measured in that process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        argv = [
            "--shape",
            name,
            "--modes",
            mode,
            "--configs" if mode == "draft" else "--full-configs",
            spec,
            "--no-isolate",
            "--out",
            str(out),
            "--block-size",
            str(args.block_size),
            "--draft-layers",
            str(args.draft_layers),
            "--warmup",
            str(args.warmup),
            "--steps",
            str(args.steps),
        ]
        optional = {
            "--seq-len": args.seq_len,
            "--num-anchors": args.num_anchors,
            "--batch-size": args.batch_size,
            "--dtype": args.dtype,
            "--matmul-size": args.matmul_size,
            "--profile": args.profile,
        }
        argv += [x for flag, value in optional.items() if value is not None for x in (flag, str(value))]
        argv += ["--trainer-loop"] if args.trainer_loop else []
        argv += ["--compile-target"] if args.compile_target else []
        argv += ["--target-cuda-graph", args.target_cuda_graph]
        done = subprocess.run([sys.executable, __file__, *argv], check=False)
        rows = json.loads(out.read_text())["results"] if out.exists() else []
    if rows:
        return rows[0]
    return {"shape": name, "mode": mode, "config": spec, "error": f"case process exited {done.returncode}"}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shape",
        nargs="+",
        default=None,
        choices=sorted(SHAPES),
        help="default: qwen3-1.7b qwen3-8b (with --tiny: tiny); the tiny-* shapes are CPU-sized versions "
        "of smollm2-135m, whisper-base and qwen3-asr-1.7b(-packed)",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="CPU regression run: fp32, sdpa configs, the tiny shape unless --shape names tiny-* shapes.",
    )
    p.add_argument("--modes", nargs="+", default=["draft", "full"], choices=["draft", "full"])
    p.add_argument("--configs", nargs="+", default=None, help="e.g. attn=flex,ce=2048,ckpt=0,compile=none")
    p.add_argument("--full-configs", nargs="+", default=None, help="configs for mode full (default: the first)")
    p.add_argument("--seq-len", type=int, default=None, help="default: per shape (1024 for 1.7B, 3072 for 8B)")
    p.add_argument("--num-anchors", type=int, default=None, help="default: per shape (256 for 1.7B, 512 for 8B)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows of the text shapes, utterances of whisper-base (default: per shape, 1 for qwen3)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--matmul-size", type=int, default=None, help="n of the n^3 ceiling matmul (8192 on CUDA)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    p.add_argument(
        "--trainer-loop",
        action="store_true",
        help="also time Trainer.train() on the same batch (CUDA: and list where its steps synchronize)",
    )
    p.add_argument(
        "--no-isolate",
        action="store_true",
        help="CUDA: run every case in this process (default: "
        "one fresh process per case, so compiled state of one case cannot affect the next)",
    )
    p.add_argument("--profile", default=None, help="CUDA: write a torch.profiler operator table per case here")
    p.add_argument(
        "--compile-target",
        "--compile_target",
        dest="compile_target",
        action="store_true",
        help="torch_compile_layers [target]: torch.compile the frozen target's decoder layers (CUDA; mode full)",
    )
    p.add_argument(
        "--target-cuda-graph",
        default="auto",
        choices=["auto", "on", "off"],
        help="target_cuda_graph (mode full): auto = the product default (a graph on a GPU where the target "
        "can be captured), on = always, off = the eager target forward",
    )
    return p


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.shape is None:
        args.shape = ["tiny"] if args.tiny else ["qwen3-1.7b", "qwen3-8b"]
    elif args.tiny and not all(name.startswith("tiny") for name in args.shape):
        raise ValueError(f"--tiny runs on the CPU: --shape must name tiny shapes, got {args.shape}")
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
                        row = {
                            "shape": name,
                            "mode": mode,
                            "config": spec,
                            "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback_tail(exc),
                        }
                report["results"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "flops"}), flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(report, indent=1))
        del tmodel
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        f"\n{'shape':<11} {'mode':<5} {'config':<36} {'ms':>8} {'TFLOP/s':>8} {'MFU':>6} {'pipe ms':>8} "
        f"{'MFU':>6} {'peak GiB':>8}"
    )
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
