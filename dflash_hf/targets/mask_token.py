"""Mask-token candidates: ids a user can pass as `--mask_token_id` when they did not choose one.

The draft fills every slot after a block's anchor with the target's embedding of `mask_token_id`, so the id
needs a row in the target's input embedding and must never occur in the data. Candidates, best first:

1. tokens named as a mask (the tokenizer's `mask_token`, or an added token whose text contains "mask");
2. embedding rows past the tokenizer's vocabulary (the tokenizer never produces them; Qwen3 checkpoints pad
   the embedding to 151936 rows), plus any other ids the target itself proposes;
3. reserved / placeholder tokens (added tokens named "reserved", "unused", "placeholder", "extra_id");
4. other added special tokens that neither the chat template, the tokenizer's named roles (pad, eos, audio
   placeholder, ...) nor the target config's `*_token_id` fields use.

Only the first two are safe by construction; for the others the user must check their data never holds them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_MASK_NAME = re.compile(r"mask", re.IGNORECASE)
_RESERVED_NAME = re.compile(r"reserved|unused|placeholder|extra_id", re.IGNORECASE)
PAST_VOCAB_SHOWN = 3  # rows past the tokenizer listed (they are interchangeable)


@dataclass(frozen=True)
class MaskTokenCandidate:
    token_id: int
    token: str | None  # the token's text, None for a row the tokenizer has no token for
    reason: str

    def __str__(self) -> str:
        name = f" {self.token}" if self.token is not None else ""
        return f"{self.token_id}{name} ({self.reason})"


def _added_tokens(tokenizer) -> dict[int, str]:
    """Added (special and non-special) tokens by id."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): str(getattr(t, "content", t)) for i, t in decoder.items()}


def _used_ids(tokenizer, target_config) -> set[int]:
    """Ids with a role: the tokenizer's named special tokens, tokens in its chat template, and every
    `*_token_id` / `*_token_index` value of the target config (and its sub-configs)."""
    used: set[int] = set()
    for role, name in (getattr(tokenizer, "special_tokens_map", None) or {}).items():
        if role != "mask_token" and isinstance(name, str):  # pad, eos, bos, audio placeholder, ...
            used.add(tokenizer.convert_tokens_to_ids(name))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        used.update(i for i, text in _added_tokens(tokenizer).items() if text in template)
    configs = [target_config] if target_config is not None else []
    while configs:
        cfg = configs.pop()
        for key, value in vars(cfg).items():
            if key.endswith(("_token_id", "_token_index")) and isinstance(value, int):
                used.add(value)
            elif key.endswith(("_token_id", "_token_ids")) and isinstance(value, (list, tuple)):
                used.update(v for v in value if isinstance(v, int))
            elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
                configs.append(value)
    return used


def mask_token_candidates(
    tokenizer, vocab_size: int, *, target_config=None, extra_ids=(), limit: int = 8
) -> list[MaskTokenCandidate]:
    """Candidate `mask_token_id`s for a target whose input embedding has `vocab_size` rows, best first
    (see the module docstring). `extra_ids` are ids the target proposes (e.g.
    `FrozenTarget.mask_token_candidates`); at most `limit` candidates."""
    added = {i: t for i, t in _added_tokens(tokenizer).items() if i < vocab_size}
    used = _used_ids(tokenizer, target_config)
    out: list[MaskTokenCandidate] = []
    seen: set[int] = set()

    def add(token_id: int, reason: str) -> None:
        if token_id not in seen and 0 <= token_id < vocab_size:
            seen.add(token_id)
            out.append(MaskTokenCandidate(token_id, added.get(token_id), reason))

    mask = getattr(tokenizer, "mask_token_id", None)
    if isinstance(mask, int):
        add(mask, "the tokenizer's mask token")
    for i, text in sorted(added.items()):
        if _MASK_NAME.search(text):
            add(i, "a token reserved as a mask")
    for i in range(len(tokenizer), vocab_size)[:PAST_VOCAB_SHOWN]:
        add(i, "embedding row past the tokenizer's vocabulary: never produced")
    for i in extra_ids:
        add(
            int(i),
            "embedding row past the tokenizer's vocabulary: never produced"
            if i >= len(tokenizer)
            else "proposed by the target family",
        )
    for i, text in sorted(added.items()):
        if _RESERVED_NAME.search(text) and i not in used:
            add(i, "a reserved/placeholder token; check your data never contains it")
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i in sorted(added):
        if i in special and i not in used:
            add(i, "an added special token the chat template and the processor do not use; check your data")
    return out[:limit]


def missing_mask_token_message(candidates: list[MaskTokenCandidate], flag: str = "--mask_token_id") -> str:
    """The error for a missing mask token id: what the id must be, and the candidates (best first)."""
    head = (
        f"{flag} is required: a token id with a row in the target's input embedding that your data never uses "
        "(not pad, eos or any token of the chat template)."
    )
    if not candidates:
        return (
            f"{head} No candidate found: the embedding is exactly the tokenizer's vocabulary and it has no "
            "reserved or unused special token; pick a token your data never contains."
        )
    listed = "\n".join(f"  {c}" for c in candidates)
    return f"{head} Candidates, best first:\n{listed}\ne.g. {flag} {candidates[0].token_id}"


def mask_token_role(tokenizer, mask_token_id: int, template_ids=()) -> str | None:
    """Why `mask_token_id` cannot be the mask token, or None: it is an id of `template_ids` (what the rendered chat
    template emits around any sample: the turn markers, the audio placeholder), a named role of the tokenizer (pad,
    eos, ...), or an added token the chat template's text holds. (pad and eos of the target's configs are refused by
    ``FrozenTarget.validate``.)"""
    token = tokenizer.convert_ids_to_tokens(mask_token_id) if mask_token_id < len(tokenizer) else None
    shown = f" ({token!r})" if token is not None else ""
    if mask_token_id in set(template_ids):
        return f"is a token{shown} the chat template writes into every sample"
    for role, name in (getattr(tokenizer, "special_tokens_map", None) or {}).items():
        if role != "mask_token" and isinstance(name, str) and tokenizer.convert_tokens_to_ids(name) == mask_token_id:
            return f"is the tokenizer's {role}{shown}"
    template = getattr(tokenizer, "chat_template", None)
    added = _added_tokens(tokenizer).get(mask_token_id)
    if isinstance(template, str) and added is not None and added in template:
        return f"is a token{shown} of the chat template"
    return None


def mask_token_fix(tokenizer, target_config=None, flag: str = "--mask_token_id") -> str:
    """The fix for a mask token id that is in use: the best candidates (`mask_token_candidates`)."""
    text_config = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    vocab_size = getattr(text_config, "vocab_size", None) or len(tokenizer)
    candidates = mask_token_candidates(tokenizer, vocab_size, target_config=target_config, limit=3)
    if not candidates:
        return f"set {flag} to a token id with an embedding row that your data never uses"
    return (
        f"set {flag} to an id your data never uses, e.g. {candidates[0].token_id} (candidates: "
        + "; ".join(map(str, candidates))
        + ")"
    )


__all__ = [
    "MaskTokenCandidate",
    "mask_token_candidates",
    "mask_token_fix",
    "mask_token_role",
    "missing_mask_token_message",
]
