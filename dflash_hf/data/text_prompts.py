"""Text prompts of JSON lines (`dflash-eval --data` for a text target): `{"prompt": "raw text"}` (tokenized as is) or
`{"messages": [...]}` (the chat template with its generation prompt), each line one prompt."""

from __future__ import annotations

from collections.abc import Iterator

from dflash_hf.data.bad_samples import BadSamples
from dflash_hf.data.json_rows import json_rows
from dflash_hf.data.user_text import SURROGATE_FIX, surrogate_problem


def json_records(path: str) -> Iterator[tuple[str, dict]]:
    """``(origin, record)`` of each JSON object line of a plain or gzipped JSON-lines file (detected by content,
    as the data layer reads manifests); a line that is not a JSON object is an error naming the file and line."""
    for _, origin, record in json_rows(path, BadSamples(skip=False)):
        yield origin, record


def first_record(path: str) -> dict:
    """The first JSON object line of `path` (`--data`); an empty file, or a line before it that is not a JSON object,
    is an error (`json_rows.first_valid_record` skips such lines)."""
    for _, record in json_records(path):
        return record
    raise ValueError(f"--data {path!r} is empty")


def count_records(path: str) -> int:
    """JSON object lines of a JSON-lines file (plain or gzipped): the progress bar's total."""
    return sum(1 for _ in json_records(path))


def is_text_prompts(path: str) -> bool:
    """Whether `path` holds JSON lines of text prompts (`prompt` / `messages`) rather than a manifest."""
    record = first_record(path)
    return "prompt" in record or "messages" in record


def _strings(value, where: str) -> Iterator[tuple[str, str]]:
    """(field path, text) of every string inside a JSON value."""
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{where}.{k}" if where else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{where}[{i}]")


def text_prompts(path: str, tokenizer) -> Iterator[dict]:
    """Target inputs of each `{"prompt": ...}` / `{"messages": [...]}` line (tokenized as the user wrote them: a
    control token's text in a prompt is that token; a lone surrogate is an error naming the line)."""
    for origin, record in json_records(path):
        for where, text in _strings(record, ""):
            problem = surrogate_problem(text)
            if problem:
                raise ValueError(f"--data {origin}: field {where!r} {problem}; {SURROGATE_FIX}")
        if "messages" in record:
            text = tokenizer.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True)
            enc = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        elif "prompt" in record:
            enc = tokenizer(record["prompt"], return_tensors="pt")
        else:
            raise ValueError(f"--data {origin}: needs a 'prompt' (text) or 'messages' (chat) key")
        yield {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


__all__ = ["count_records", "first_record", "is_text_prompts", "json_records", "text_prompts"]
