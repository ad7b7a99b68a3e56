"""The requests of `vllm_parity.py`: JSON-lines rows checked and rendered as prompts (text, token ids, audio)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from dflash_hf.errors import DFlashUserError

PROMPT_KEYS = ("messages", "prompt", "text")


def read_requests(path: str | Path, limit: int = 0) -> list[dict]:
    """The request rows of a JSON-lines file, checked before anything loads; a bad row names its line and the fix."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DFlashUserError(f"{where} is not JSON ({err.msg}); one request object per line") from err
        if not isinstance(row, dict):
            raise DFlashUserError(f"{where} holds a JSON {type(row).__name__}; one request object per line")
        given = [k for k in PROMPT_KEYS if k in row]
        if len(given) != 1:
            raise DFlashUserError(f"{where} needs exactly one of {list(PROMPT_KEYS)}, has {given or 'none'}")
        if given[0] == "messages" and not (isinstance(row["messages"], list) and row["messages"]):
            raise DFlashUserError(f"{where}: 'messages' must be a non-empty list of chat messages")
        if given[0] != "messages" and not isinstance(row[given[0]], str):
            raise DFlashUserError(f"{where}: {given[0]!r} must be a string")
        audio = row.get("audio")
        if audio is not None:
            clip = Path(audio) if Path(audio).is_absolute() else Path(path).parent / audio
            if not clip.is_file():
                raise DFlashUserError(f"{where}: audio file {audio} does not exist")
            row = {**row, "audio": str(clip)}
        rows.append(row)
        if limit and len(rows) == limit:
            break
    if not rows:
        raise DFlashUserError(f"{path} holds no requests")
    return rows


def render(row: dict, tokenizer, processor=None) -> str | list[int]:
    """A request's prompt: its text (`text`, or an audio request's rendered chat), or a text request's token ids. An
    audio request renders with the processor's chat template where it has one (what dflash-train renders audio
    conversations with), else the tokenizer's."""
    if "text" in row:
        return row["text"] if row.get("audio") else tokenizer(row["text"], add_special_tokens=False)["input_ids"]
    messages = row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]
    tokenize = not row.get("audio")
    owner = processor if not tokenize and getattr(processor, "chat_template", None) else tokenizer
    out = owner.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize)
    return list(out["input_ids"] if isinstance(out, Mapping) else out) if tokenize else out


def load_audio(path: str, sampling_rate: int):
    import soundfile

    wave, rate = soundfile.read(path, dtype="float32", always_2d=True)
    if rate != sampling_rate:
        raise DFlashUserError(f"{path} is sampled at {rate} Hz; the target's processor takes {sampling_rate} Hz")
    return wave.mean(axis=1)


def load_processor(target: str):
    from transformers import AutoProcessor, AutoTokenizer

    try:
        processor = AutoProcessor.from_pretrained(target)
    except (OSError, ValueError):
        processor = AutoTokenizer.from_pretrained(target)
    return processor, getattr(processor, "tokenizer", processor)


def sampling_rate_of(processor) -> int:
    return getattr(getattr(processor, "feature_extractor", None), "sampling_rate", 16000)


def vllm_prompts(rows: list[dict], target: str) -> list[dict]:
    processor, tokenizer = load_processor(target)
    prompts = []
    for row in rows:
        prompt = render(row, tokenizer, processor)
        if row.get("audio"):
            rate = sampling_rate_of(processor)
            prompts.append({"prompt": prompt, "multi_modal_data": {"audio": (load_audio(row["audio"], rate), rate)}})
        else:
            prompts.append({"prompt_token_ids": prompt})
    return prompts
