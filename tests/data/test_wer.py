"""Word error rate: normalization, word-level edit distance, corpus rate."""

from __future__ import annotations

import pytest

from dflash_hf.data.wer import corpus_wer, normalize, word_errors


def test_word_error_rate():
    words = ["hello", "world", "it's", "a", "well", "known", "fact"]
    assert normalize("Hello, World! It's a well-known fact.") == words
    assert word_errors("a b c".split(), "a b c".split()) == 0
    assert word_errors("a b c".split(), "a x c d".split()) == 2  # one substitution, one insertion
    assert word_errors("a b c".split(), []) == 3
    assert word_errors([], "a b".split()) == 2
    assert corpus_wer(["The cat sat.", "on the mat"], ["the cat sat", "on a mat mat"]) == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="no words"):
        corpus_wer(["..."], ["x"])
