"""whisper_log_mel: bit-identical to WhisperFeatureExtractor, and declining where its shortcut would not be exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from dflash_hf.whisper_features import whisper_log_mel


@pytest.mark.parametrize("chunk_length", [30, 4])  # Whisper's window, and the tiny test targets' 4 s one
def test_features_equal_the_extractors_for_random_batches(chunk_length):
    fe = WhisperFeatureExtractor(feature_size=80, chunk_length=chunk_length)
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(6):
        seconds = rng.uniform(0.05, 0.7 * chunk_length, size=rng.integers(1, 5))
        audios = [rng.standard_normal(int(s * 16000)).astype(np.float32) * rng.uniform(0.01, 1) for s in seconds]
        got = whisper_log_mel(fe, audios, 16000)
        assert got is not None
        assert torch.equal(got, fe(audios, sampling_rate=16000, return_tensors="pt")["input_features"])
        checked += 1
    assert checked == 6


def test_declines_where_only_the_extractor_is_exact():
    fe = WhisperFeatureExtractor(feature_size=80, chunk_length=4)
    near_end = [np.ones(4 * 16000 - 100, np.float32)]  # reaches the end reflection
    assert whisper_log_mel(fe, near_end, 16000) is None
    assert whisper_log_mel(fe, [np.ones(8000, np.float32)], 8000) is None  # the extractor raises on this rate
    assert whisper_log_mel(WhisperFeatureExtractor(feature_size=80, chunk_length=4, dither=1.0),
                           [np.ones(8000, np.float32)], 16000) is None
