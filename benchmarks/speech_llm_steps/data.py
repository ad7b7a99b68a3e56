"""Training rows of the speech LLM: manifests, audio, the rendered conversation and its supervised tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from quality_steps.common import SAMPLING_RATE

from .presets import INSTRUCTION


def read_manifest(path: Path) -> list[dict]:
    """NeMo manifest rows; ``audio_filepath`` resolved against the manifest's directory (absolute paths kept)."""
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        for key in ("audio_filepath", "text"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise ValueError(f"{path}:{i + 1}: field {key!r} missing or empty")
        row["audio_filepath"] = str((path.parent / row["audio_filepath"]).resolve())
        row.setdefault("id", f"{path.stem}-{i}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no manifest lines")
    return rows


def load_audio(path: Path | str) -> np.ndarray:
    """Mono float32 at 16 kHz (soundfile); other sampling rates are refused."""
    import soundfile as sf

    audio, sr = sf.read(str(path), dtype="float32", always_2d=True)
    if sr != SAMPLING_RATE:
        raise ValueError(f"{path}: sampling rate {sr}, expected {SAMPLING_RATE} (resample the manifest's audio)")
    return audio.mean(axis=1)


def messages_for(text: str | None, instruction: str = INSTRUCTION) -> list[dict]:
    """The conversation dflash_hf renders for a cut with ``--prompt instruction``: the user turn is the
    instruction then the audio; the assistant turn the transcript (omitted for generation)."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": instruction}, {"type": "audio"}]}]
    if text is not None:
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
    return msgs


def render(processor, text: str | None, instruction: str = INSTRUCTION) -> tuple[str, str]:
    """The rendered conversation (transcript ``text``) and its generation prompt (the prefix before the answer)."""
    full = processor.apply_chat_template(messages_for(text, instruction), tokenize=False)
    prompt = processor.apply_chat_template(messages_for(None, instruction), tokenize=False, add_generation_prompt=True)
    if not full.startswith(prompt):
        raise ValueError("the chat template's generation prompt does not prefix the conversation")
    return full, prompt


def encode_row(processor, row: dict, n_frames: int, instruction: str = INSTRUCTION) -> tuple[list[int], list[int]]:
    """Ids of one conversation with the audio placeholder expanded to ``n_frames`` tokens (what the processor does,
    without its feature extraction) and its labels: the transcript and the end-of-turn token, -100 elsewhere."""
    tok = processor.tokenizer
    full, prompt = render(processor, row["text"], instruction)
    suffix = full[len(prompt) :]
    supervised = suffix[: suffix.index(row["text"]) + len(row["text"])] + tok.eos_token
    if not suffix.startswith(supervised):
        raise ValueError(f"{row['id']}: the assistant turn does not end with {tok.eos_token!r}: {suffix!r}")
    if prompt.count(processor.audio_token) != 1:
        raise ValueError(f"the prompt must hold one {processor.audio_token!r}: {prompt!r}")
    ids_prompt = tok(prompt.replace(processor.audio_token, processor.audio_token * n_frames), add_special_tokens=False)[
        "input_ids"
    ]
    ids_sup = tok(supervised, add_special_tokens=False)["input_ids"]
    ids_rest = tok(suffix[len(supervised) :], add_special_tokens=False)["input_ids"]
    return ids_prompt + ids_sup + ids_rest, [-100] * len(ids_prompt) + ids_sup + [-100] * len(ids_rest)


def pad_batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict:
    """Right-padded ``input_ids`` / ``attention_mask`` / ``labels`` of :func:`encode_row` outputs."""
    width = max(len(ids) for ids, _ in examples)
    out = {
        "input_ids": torch.full((len(examples), width), pad_id),
        "labels": torch.full((len(examples), width), -100),
        "attention_mask": torch.zeros(len(examples), width, dtype=torch.long),
    }
    for i, (ids, labels) in enumerate(examples):
        out["input_ids"][i, : len(ids)] = torch.tensor(ids)
        out["attention_mask"][i, : len(ids)] = 1
        out["labels"][i, : len(ids)] = torch.tensor(labels)
    return out


def pad_id_of(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def encode_training_batch(processor, rows: list[dict], n_frames: list[int], instruction: str = INSTRUCTION) -> dict:
    """:func:`pad_batch` of :func:`encode_row` for each row."""
    examples = [encode_row(processor, r, n, instruction) for r, n in zip(rows, n_frames, strict=True)]
    return pad_batch(examples, pad_id_of(processor.tokenizer))
