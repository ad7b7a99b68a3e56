"""The shapes `train_step.py` times (random-weight targets of real architectures, CPU-sized `tiny-*`
versions) and its configuration specs (`attn=flex,ce=2048,...`)."""

from __future__ import annotations

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
# The decoder dimensions a text-only `qwen3` shape takes (`models.build_target`).
DECODER_DIMS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)


def _decoder_dims(config: dict) -> dict:
    return {k: config[k] for k in DECODER_DIMS}


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
    text_config=QWEN3_1_7B_TEXT | _decoder_dims(TINY_LLAMA) | dict(vocab_size=600, pad_token_id=510, eos_token_id=510),
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
_QWEN3_1_7B = _decoder_dims(QWEN3_1_7B_TEXT)
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
    "tiny": dict(_decoder_dims(TINY_LLAMA), seq_len=96, num_anchors=16),
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
