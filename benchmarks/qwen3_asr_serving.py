"""A Qwen3-ASR target of Qwen3-ASR-1.7B's shape, built from a config (random weights), its DFlash draft trained
briefly, and speech prompts, for serving-parity runs (`benchmarks/vllm_parity.py`).

    python benchmarks/qwen3_asr_serving.py build --out runs/qwen3-asr-1.7b       # target, processor, speech sets
    python benchmarks/qwen3_asr_serving.py train --out runs/qwen3-asr-1.7b       # dflash-train -> draft/
    python benchmarks/qwen3_asr_serving.py prompts --out runs/qwen3-asr-1.7b     # speech.jsonl (held-out clips)
    python benchmarks/vllm_parity.py --target runs/qwen3-asr-1.7b/target --draft runs/qwen3-asr-1.7b/draft \\
        --prompts runs/qwen3-asr-1.7b/speech.jsonl --out docs/results/serving_qwen3_asr_1.7b.json

`build` writes `target/` (a `Qwen3ASRForConditionalGeneration` with Qwen3-ASR-1.7B's dimensions: a 24-layer,
1024-wide audio encoder over 128 mel bins, projected to 2048; a 28-layer Qwen3 text model, 2048 wide, 16 query and 8
key/value heads of 128, 151936 embedding rows, RoPE theta 1e6; random weights, saved in bf16, with the audio-config
fields vLLM reads beyond transformers', `add_vllm_serving_fields`) and its processor (the package's byte-level
tokenizer and chat template: the embedding rows past its 263 tokens are never produced by text), plus synthetic speech
(`speech_train/`, `speech_dev/`: tone words, NeMo manifests). `train` runs `dflash-train` on the train set with the
target's own greedy labels (`label_source=target_argmax`) and the instruction below; `prompts` writes one request per
held-out clip, the training conversation up to the answer (`messages` with an audio item, `audio` its file), as
`vllm_parity.py` reads them (`--manifest`: the clips of any NeMo manifest, e.g. `dflash-demo`'s held-out set or
another target's evaluation set). A random target's continuations say little about a real one: the rows measure that
vLLM serves the shape and reads the export as trained, not a realistic acceptance. `--shape tiny` builds a small
target of the same family (head_dim 64) for a CPU smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from train_step_parts.shapes import QWEN3_1_7B_TEXT, QWEN3_ASR_1_7B

# set by `build_target` from the tokenizer (and the model type), not taken from the shape
TOKENIZER_FIELDS = ("model_type", "tie_word_embeddings", "pad_token_id", "eos_token_id")
INSTRUCTION = "Transcribe the audio."
SHAPES = {
    "1.7b": {  # the dimensions of train_step.py's qwen3-asr-1.7b shape; token ids come from the tokenizer
        "audio": {
            k: v
            for k, v in QWEN3_ASR_1_7B["audio_config"].items()
            if k not in ("model_type", "max_position_embeddings")
        },
        "text": {k: v for k, v in QWEN3_1_7B_TEXT.items() if k not in TOKENIZER_FIELDS}
        | {"rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}},
    },
    "tiny": {  # the smoke shape: every dimension small, head_dim 64 (what vLLM's attention backends take)
        "audio": dict(
            num_mel_bins=128,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=64,
            d_model=32,
            output_dim=128,
            n_window=50,
            n_window_infer=800,
            downsample_hidden_size=8,
        ),
        "text": dict(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
    },
}


def build_target(shape: str, seed: int = 0):
    """The Qwen3-ASR model of `shape` (random, eval) and its processor."""
    import torch
    from transformers import (
        Qwen3ASRConfig,
        Qwen3ASRFeatureExtractor,
        Qwen3ASRForConditionalGeneration,
        Qwen3ASRProcessor,
    )

    from dflash_hf.targets.families.qwen3_asr import add_vllm_serving_fields
    from dflash_hf.testing import tiny

    tokenizer = tiny.build_tokenizer()
    dims = SHAPES[shape]
    if dims["text"]["vocab_size"] < len(tokenizer):
        raise ValueError(f"shape {shape}: vocab_size {dims['text']['vocab_size']} < the tokenizer's {len(tokenizer)}")
    config = Qwen3ASRConfig(
        audio_config=dict(model_type="qwen3_asr_encoder", **dims["audio"]),
        text_config=dict(
            model_type="qwen3",
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
            **dims["text"],
        ),
        audio_token_id=tokenizer.convert_tokens_to_ids(tiny.AUDIO_PAD),
        timestamp_token_id=tokenizer.convert_tokens_to_ids(tiny.MASK_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    add_vllm_serving_fields(config)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen3ASRForConditionalGeneration(config).eval()
    for key, value in (("pad_token_id", tokenizer.pad_token_id), ("eos_token_id", tokenizer.eos_token_id)):
        setattr(model.generation_config, key, value)
    model.generation_config.bos_token_id = None
    model.generation_config.do_sample = False
    extractor = Qwen3ASRFeatureExtractor(feature_size=dims["audio"]["num_mel_bins"], sampling_rate=tiny.SAMPLING_RATE)
    processor = Qwen3ASRProcessor(feature_extractor=extractor, tokenizer=tokenizer, chat_template=tiny.CHAT_TEMPLATE)
    return model, processor


def build(out: Path, shape: str, train_utterances: int, dev_utterances: int, seed: int) -> None:
    import torch

    from dflash_hf.testing import tiny

    model, processor = build_target(shape, seed)
    dtype = torch.bfloat16 if shape == "1.7b" else torch.float32
    model.to(dtype).save_pretrained(out / "target")
    processor.save_pretrained(out / "target")
    tiny.synthesize_speech(out / "speech_train", train_utterances, seed=seed)
    tiny.synthesize_speech(out / "speech_dev", dev_utterances, seed=seed + 1)
    parameters = sum(p.numel() for p in model.parameters())
    (out / "built.json").write_text(json.dumps({"shape": shape, "parameters": parameters, "dtype": str(dtype)}) + "\n")
    print(f"{shape} Qwen3-ASR target ({parameters / 1e6:.0f}M parameters, {dtype}) and speech sets written to {out}")


def train_argv(out: Path, steps: int, precision: str, use_cpu: bool) -> list[str]:
    """`dflash-train`'s command line for the draft: the target's own greedy labels, the instruction as the prompt."""
    from dflash_hf.testing import tiny

    mask_id = tiny.build_tokenizer().convert_tokens_to_ids(tiny.MASK_TOKEN)
    argv = ["--target_name_or_path", str(out / "target"), "--train_data", str(out / "speech_train" / "manifest.jsonl")]
    argv += ["--prompt", INSTRUCTION, "--mask_token_id", str(mask_id), "--label_source", "target_argmax"]
    argv += ["--block_size", "8", "--num_draft_layers", "1", "--num_anchors", "32", "--max_steps", str(steps)]
    argv += ["--precision", precision, "--output_dir", str(out / "run"), "--overwrite_output_dir", "true"]
    argv += ["--save_strategy", "no", "--report_to", "none", "--learning_rate", "1e-3", "--max_tokens", "6000"]
    return argv + (["--use_cpu", "true"] if use_cpu else [])


def train(out: Path, steps: int, precision: str) -> None:
    import shutil
    import subprocess
    import sys

    import torch

    argv = train_argv(out, steps, precision, use_cpu=not torch.cuda.is_available())
    subprocess.run([sys.executable, "-m", "dflash_hf.cli.train", *argv], check=True)  # the dflash-train command
    export = out / "run" / "draft"
    if not (export / "config.json").is_file():
        raise RuntimeError(f"dflash-train wrote no export at {export}")
    shutil.rmtree(out / "draft", ignore_errors=True)
    shutil.copytree(export, out / "draft")
    print(f"draft exported to {out / 'draft'}")


def prompt_rows(manifest: Path, base: Path, limit: int) -> list[dict]:
    """One `vllm_parity.py` request per clip: the conversation dflash-train renders for it with `--prompt` (the user
    turn: the instruction, then the audio), without the answer; the clip's path relative to `base` (the prompts
    file's folder, against which `vllm_parity.py` resolves it; a clip outside it gets a path through `..`)."""
    rows = []
    for line in manifest.read_text().splitlines()[:limit]:
        clip = (manifest.parent / json.loads(line)["audio_filepath"]).resolve()
        user = [{"type": "text", "text": INSTRUCTION}, {"type": "audio"}]
        rows.append({"messages": [{"role": "user", "content": user}], "audio": os.path.relpath(clip, base.resolve())})
    return rows


def prompts(out: Path, limit: int, manifest: Path | None = None) -> Path:
    """`speech.jsonl` in `out`: one request per clip of `manifest` (default: the held-out set `build` wrote)."""
    rows = prompt_rows(manifest or out / "speech_dev" / "manifest.jsonl", out, limit)
    path = out / "speech.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} speech prompts written to {path}")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="the target (random weights), its processor and synthetic speech sets")
    b.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    b.add_argument("--train_utterances", type=int, default=400)
    b.add_argument("--dev_utterances", type=int, default=40)
    b.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("train", help="dflash-train the draft on the train set (the target's own greedy labels)")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p = sub.add_parser("prompts", help="speech.jsonl: one request per held-out clip")
    p.add_argument("--num_prompts", type=int, default=40)
    p.add_argument("--manifest", type=Path, default=None, help="NeMo manifest; default OUT/speech_dev/manifest.jsonl")
    for s in (b, t, p):
        s.add_argument("--out", type=Path, required=True, help="the folder of the target, speech sets and draft")
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.out, args.shape, args.train_utterances, args.dev_utterances, args.seed)
    elif args.command == "train":
        train(args.out, args.steps, args.precision)
    else:
        prompts(args.out, args.num_prompts, args.manifest)


if __name__ == "__main__":
    main()
