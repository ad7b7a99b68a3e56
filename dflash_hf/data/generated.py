"""What `dflash-generate-labels` keeps beside a generated transcript (docs/GENERATED_LABELS.md):

- ``label_ids``: the target's own tokens of the response, written where the text's tokens differ from them (a
  tokenizer re-encodes a decoded text canonically, a model may write a word in other pieces). Training takes these
  ids for the response (and for the template's whitespace right before it, which the target writes itself) instead
  of the text's, so the row is the target's own stream and the draft learns the tokens the target writes; the text
  stays for reading and evaluation. The ids must decode to the row's text (the same decoding the tool used:
  special tokens skipped, surrounding spaces stripped), lie in the tokenizer's vocabulary and hold neither an end
  token nor the audio placeholder. A row whose decoded text is empty keeps none (it is not a usable row).
- ``truncated``: true where the output was cut by ``--max_new_tokens`` before the target's end token. Such a row is
  trained without the end of its turn: the rendered conversation stops after the response, so neither the end token
  nor its supervision is there (the draft is not taught to stop where the target went on). Its text is what the
  target wrote until the limit (often a repetition loop), not a transcript of its audio: training's
  characters-per-second check (``json_rows.text_rate_problem``) does not apply to it (:func:`rate_problem`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dflash_hf.data.json_rows import RATE_FIX, text_rate_problem

LABEL_IDS_KEY = "label_ids"
TRUNCATED_KEY = "truncated"
REGENERATE_FIX = "write the row again with dflash-generate-labels, or remove 'label_ids' to train on the text's tokens"


def generated_fields(cut) -> tuple[list[int] | None, bool]:
    """``(label_ids or None, truncated)`` of a cut (its custom fields; a NeMo line's extra keys land there)."""
    custom = cut.custom or {}
    return custom.get(LABEL_IDS_KEY), custom.get(TRUNCATED_KEY) is True


def rate_problem(fields: Mapping, text, duration, max_chars_per_second: float | None) -> tuple[str, str, str] | None:
    """``("text", problem, fix)`` where a row's `text` is implausibly long for `duration` seconds of audio
    (`json_rows.text_rate_problem`), else None; never for a row (`fields`: a manifest line, or a cut's custom fields)
    marked ``truncated`` (the target's own output cut by a token limit, not a transcript of a wrong duration)."""
    if fields.get(TRUNCATED_KEY) is True:
        return None
    problem = text_rate_problem(text, duration, max_chars_per_second)
    return ("text", problem, RATE_FIX) if problem else None


def row_problem(fields: Mapping, text, duration, max_chars_per_second: float | None) -> tuple[str, str, str] | None:
    """``(field, problem, fix)`` of the checks a manifest or cuts reader makes of a row's text and generated-label
    fields (`fields`: a manifest line, or a cut's custom fields): their types (:func:`generated_field_problem`), then
    the characters per second (:func:`rate_problem`); None when it passes."""
    return generated_field_problem(fields) or rate_problem(fields, text, duration, max_chars_per_second)


def decoded_response(tokenizer, ids: Sequence[int]) -> str:
    """The text `dflash-generate-labels` writes for the generated `ids`: decoded without special tokens, stripped."""
    return tokenizer.decode(list(ids), skip_special_tokens=True).strip()


def end_ids(tokenizer) -> set[int]:
    """Ids that end a response (end of text and padding): never part of ``label_ids``."""
    return {i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if isinstance(i, int)}


def generated_field_problem(fields: Mapping) -> tuple[str, str, str] | None:
    """``(field, problem, fix)`` where a row's ``truncated`` / ``label_ids`` (`fields`: a manifest line, or a cut's
    custom fields) have the wrong type, else None: the checks that need no tokenizer (the data pre-flight's)."""
    truncated = fields.get(TRUNCATED_KEY)
    if truncated is not None and not isinstance(truncated, bool):
        return TRUNCATED_KEY, f"is {truncated!r:.40}, not true or false", "write 'truncated' as a JSON boolean"
    ids = fields.get(LABEL_IDS_KEY)
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        return LABEL_IDS_KEY, f"is {ids!r:.60}, not a non-empty list of token ids", REGENERATE_FIX
    negative = [i for i in ids if i < 0]
    if negative:
        return LABEL_IDS_KEY, f"holds negative ids {negative[:5]}", REGENERATE_FIX
    return None


def generated_problem(cut, tokenizer, text: str, audio_id: int | None = None) -> tuple[str, str, str] | None:
    """``(field, problem, fix)`` where a cut's ``truncated`` or ``label_ids`` cannot be used, else None: the type
    checks (`generated_field_problem`), then those against the tokenizer. `audio_id`: the target's audio placeholder,
    which a response can never hold (the target would take it for audio)."""
    custom = cut.custom or {}
    found = generated_field_problem(custom)
    ids = custom.get(LABEL_IDS_KEY)
    if found or ids is None:
        return found
    vocab = len(tokenizer)
    outside = [i for i in ids if i >= vocab]
    if outside:
        return LABEL_IDS_KEY, f"holds ids {outside[:5]} outside the tokenizer's vocabulary of {vocab}", REGENERATE_FIX
    if audio_id is not None and audio_id in ids:
        return LABEL_IDS_KEY, f"holds the audio placeholder id {audio_id}", REGENERATE_FIX
    ends = sorted(end_ids(tokenizer).intersection(ids))
    if ends:
        return (
            LABEL_IDS_KEY,
            f"holds the end token id {ends[0]}: the response's ids stop before the end (the template closes the turn)",
            REGENERATE_FIX,
        )
    decoded = decoded_response(tokenizer, ids)
    if decoded != text.strip():
        return (
            LABEL_IDS_KEY,
            f"decode to {decoded[:60]!r}, not the row's text {text.strip()[:60]!r} (the text was edited, or the ids "
            "belong to another tokenizer)",
            REGENERATE_FIX,
        )
    return None


def splice_response(
    cut_id: str,
    suffix: str,
    ids: list[int],
    offsets: Sequence[tuple[int, int]],
    supervised: list[bool],
    response: str,
    label_ids: list[int],
) -> tuple[list[int], list[bool]]:
    """The suffix's ids and supervision with the response's tokens (the supervised ones, before the closing token is
    marked) replaced by `label_ids`. The replaced tokens must cover the response and nothing of the template but
    spaces. The whitespace tokens right before the response (a template's separating space, e.g. Whisper's before
    its transcript) are replaced too: the target wrote its own (the generated ids follow the generation prompt), so
    the row is the target's stream, generation prompt + `label_ids` + the turn's end."""
    marked = [i for i, flag in enumerate(supervised) if flag]
    first, last = marked[0], marked[-1]
    while first > 0 and offsets[first - 1][1] > offsets[first - 1][0]:  # a zero-width (special) token stops it
        if suffix[offsets[first - 1][0] : offsets[first - 1][1]].strip():
            break
        first -= 1
    covered = suffix[offsets[first][0] : offsets[last][1]]
    if covered.strip() != response.strip():
        raise ValueError(
            f"cut {cut_id!r}: the response's tokens also cover template text ({covered!r}), so 'label_ids' cannot "
            "replace them; remove 'label_ids' from the row to train on the text's tokens"
        )
    new_ids = ids[:first] + list(label_ids) + ids[last + 1 :]
    new_flags = [False] * first + [True] * len(label_ids) + [False] * (len(ids) - last - 1)
    return new_ids, new_flags


def splice_rows(batch: dict, samples: Sequence, padding_side: str, pad_id: int) -> dict:
    """Put each sample's `suffix_ids` in place of its text's suffix tokens (`text_suffix_ids`, where they differ) in
    a padded batch's `input_ids` / `attention_mask`, re-padded on `padding_side`. Rows without generated ids keep
    their tokens. Raises (naming the cut) where a row does not end with its text's suffix tokens."""
    if all(s.text_suffix_ids is None for s in samples):
        return batch
    ids, mask = batch["input_ids"], batch["attention_mask"]
    rows = []
    for row, sample in enumerate(samples):
        real = ids[row][mask[row].bool()].tolist()
        if sample.text_suffix_ids is not None:
            n = len(sample.text_suffix_ids)
            if real[-n:] != sample.text_suffix_ids:
                raise ValueError(
                    f"cut {sample.cut_id!r}: the assistant turn tokenizes differently inside the conversation than on "
                    "its own, so its generated ids ('label_ids') cannot be put in place; remove 'label_ids' from the "
                    "row, or use a chat template whose generation prompt ends on a token boundary"
                )
            real = real[:-n] + list(sample.suffix_ids)
        rows.append(real)
    width = max(len(r) for r in rows)
    new_ids = torch.full((len(rows), width), pad_id, dtype=ids.dtype)
    new_mask = torch.zeros((len(rows), width), dtype=mask.dtype)
    for row, real in enumerate(rows):
        cols = slice(width - len(real), width) if padding_side == "left" else slice(0, len(real))
        new_ids[row, cols] = torch.tensor(real, dtype=ids.dtype)
        new_mask[row, cols] = 1
    return {**batch, "input_ids": new_ids, "attention_mask": new_mask}


__all__ = [
    "LABEL_IDS_KEY",
    "TRUNCATED_KEY",
    "decoded_response",
    "end_ids",
    "generated_field_problem",
    "generated_fields",
    "generated_problem",
    "rate_problem",
    "row_problem",
    "splice_response",
    "splice_rows",
]
