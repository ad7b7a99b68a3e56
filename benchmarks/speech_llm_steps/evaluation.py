"""``wer``: greedy transcripts of a manifest's clips and their word error rate."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from quality_steps.common import RESULTS_DIR, tqdm, write_json

from dflash_hf.data.wer import corpus_wer, normalize, word_errors

from .data import load_audio, messages_for, read_manifest
from .presets import INSTRUCTION


@torch.no_grad()
def transcribe(
    model, processor, rows: list[dict], batch_size: int = 8, max_new_tokens: int = 160, instruction: str = INSTRUCTION
) -> tuple[list[str], list[int]]:
    """Greedy ``generate`` on left-padded processor batches; returns hypotheses and generated token counts."""
    from dflash_hf.targets.families.registry import encode_batch, resolve_family

    family = resolve_family(model.config, "qwen2_audio")
    prompt = processor.apply_chat_template(messages_for(None, instruction), tokenize=False, add_generation_prompt=True)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    hyps, counts = [], []
    for i in tqdm(range(0, len(rows), batch_size), desc="generate", unit="batch"):
        chunk = rows[i : i + batch_size]
        batch = encode_batch(
            family,
            processor,
            model.config,
            [prompt] * len(chunk),
            [load_audio(r["audio_filepath"]) for r in chunk],
            padding_side="left",
        )
        batch = {k: v.to(model.device) for k, v in batch.items()}
        out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens)
        new = out[:, batch["input_ids"].shape[1] :]
        for seq in new:
            ids = seq.tolist()
            n = next((k + 1 for k, t in enumerate(ids) if t in eos), len(ids))
            counts.append(n)
            hyps.append(processor.tokenizer.decode(ids[:n], skip_special_tokens=True).strip())
    return hyps, counts


def wer(
    model_dir: Path,
    manifest: Path,
    num_samples: int = 64,
    batch_size: int = 8,
    device: str = "auto",
    precision: str = "bf16",
    max_new_tokens: int = 160,
    output: Path | None = None,
    instruction: str = INSTRUCTION,
) -> dict:
    """Greedy transcription WER on the first ``num_samples`` manifest rows; JSON with per-sample hypotheses."""
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from dflash_hf.export.evaluation_setup import evaluation_device

    if num_samples < 1:
        raise ValueError(f"--num_samples must be >= 1, got {num_samples}")
    rows = read_manifest(manifest)[:num_samples]
    device = str(evaluation_device(device))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    t0 = time.time()
    hyps, counts = transcribe(model, processor, rows, batch_size, max_new_tokens, instruction)
    seconds = time.time() - t0
    refs = [r["text"] for r in rows]
    result = {
        "model": str(model_dir),
        "manifest": str(manifest),
        "num_samples": len(rows),
        "precision": precision,
        "device": device,
        "batch_size": batch_size,
        "wer": round(corpus_wer(refs, hyps), 4),
        "generate_seconds": round(seconds, 1),
        "seconds_per_clip": round(seconds / len(rows), 3),
        "truncated": sum(c >= max_new_tokens for c in counts),
        "samples": [
            {
                "id": r["id"],
                "speaker": r.get("speaker"),
                "ref": r["text"],
                "hyp": h,
                "errors": word_errors(normalize(r["text"]), normalize(h)),
                "words": len(normalize(r["text"])),
            }
            for r, h in zip(rows, hyps)
        ],
    }
    recipe = model_dir / "recipe.json"
    if recipe.is_file():
        result["recipe"] = {k: v for k, v in json.loads(recipe.read_text()).items() if k != "loss_curve"}
    output = output or RESULTS_DIR / f"speech_llm_wer_{manifest.stem}.json"
    write_json(output, result)
    print(f"WER {result['wer']:.2%} on {len(rows)} clips ({seconds:.1f} s) -> {output}")
    return result
