"""User text is text: what a data row says (the response, its context, its system prompt) must not become a control
token or fail to encode.

A tokenizer turns the text of any added token into that token's id wherever it appears, so a transcript holding
``<|im_end|>``, ``<|im_start|>assistant`` or ``<|endoftext|>`` would put a fake turn boundary into the supervised
labels, and one holding the audio placeholder or the mask token would break the batch. Such a row is a bad sample
naming its field and the token (raised, or skipped and counted with ``--skip_bad_samples``): the check holds for every
family, since every family's template writes the row's text into the rendered stream as is. Control tokens are the
tokenizer's added tokens marked special, and added tokens written like markers (``<...>``, ``[...]``: ``<think>``,
Whisper's timestamps). A lone UTF-16 surrogate (JSON ``"\\ud800"`` without its pair) is a bad sample too: it is not
text any tokenizer or UTF-8 file can hold.
"""

from __future__ import annotations

import re

_MARKER = re.compile(r"^(<[^<>\s]+>|\[[^\[\]\s]+\])$")
_SURROGATE = re.compile("[\ud800-\udfff]")


SURROGATE_FIX = "write the text as valid UTF-8 (escape characters beyond U+FFFF as surrogate pairs, or not at all)"


def surrogate_problem(text: str) -> str | None:
    """Where `text` holds a lone UTF-16 surrogate, or None."""
    found = _SURROGATE.search(text)
    if found is None:
        return None
    return (
        f"holds a lone UTF-16 surrogate {found.group()!r} at character {found.start()}, which is not text (a JSON "
        "'\\ud800'-style escape without its pair)"
    )


def control_tokens(tokenizer) -> list[str]:
    """The strings ``tokenizer`` turns into a control token id wherever they appear (see the module docstring)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    out = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for token in decoder.values():
        content = str(getattr(token, "content", token))
        if getattr(token, "special", False) or _MARKER.match(content):
            out.add(content)
    return sorted((t for t in out if t.strip()), key=len, reverse=True)


class UserTextCheck:
    """``problem(field, text)``: ``(field, problem, fix)`` when ``text`` holds a control token or a lone surrogate,
    else None. Cheap on ordinary text: only texts holding a control token's first character are searched."""

    def __init__(self, tokenizer):
        tokens = control_tokens(tokenizer)
        self._first_chars = {t[0] for t in tokens}
        self._pattern = re.compile("|".join(map(re.escape, tokens))) if tokens else None

    def problem(self, field: str, text: str) -> tuple[str, str, str] | None:
        surrogate = surrogate_problem(text)
        if surrogate:
            return field, surrogate, SURROGATE_FIX
        if self._pattern is None or not any(c in text for c in self._first_chars):
            return None
        found = self._pattern.search(text)
        if found is None:
            return None
        return (
            field,
            f"holds the tokenizer's control token {found.group()!r} (at character {found.start()}): it would be "
            "encoded as that token, not as text (a fake turn boundary, placeholder or end of text)",
            "remove or rewrite the token's text in the data (e.g. drop the markup, or put a space inside it)",
        )
