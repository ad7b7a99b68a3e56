"""Word error rate of transcripts against references: text normalized to words (lowercase, punctuation stripped),
then the word-level edit distance. Light module: no torch."""

from __future__ import annotations

import re


def normalize(text: str) -> list[str]:
    """Lowercase, punctuation stripped (apostrophes inside words kept, hyphens split), words."""
    text = text.lower().replace("-", " ")
    text = re.sub(r"[^\w' ]+", " ", text)
    return [w.strip("'") for w in text.split() if w.strip("'")]


def word_errors(ref: list[str], hyp: list[str]) -> int:
    """Word-level Levenshtein distance (substitutions + insertions + deletions)."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def corpus_wer(refs: list[str], hyps: list[str]) -> float:
    """Total word errors over total reference words (normalized)."""
    errors = sum(word_errors(normalize(r), normalize(h)) for r, h in zip(refs, hyps, strict=True))
    words = sum(len(normalize(r)) for r in refs)
    if words == 0:
        raise ValueError("references hold no words")
    return errors / words


__all__ = ["corpus_wer", "normalize", "word_errors"]
