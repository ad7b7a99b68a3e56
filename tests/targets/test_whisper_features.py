"""whisper_log_mel: bit-identical to WhisperFeatureExtractor, and declining where its shortcut would not be exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from dflash_hf.targets.families.whisper_features import (
    AUDIO_WAVES_KEY,
    COMPACT_FEATURES_KEY,
    expand_window,
    is_standard_extractor,
    whisper_log_mel,
    with_fast_features,
    with_whole_window,
)


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
        want = fe(audios, sampling_rate=16000, return_tensors="pt")["input_features"]
        assert torch.equal(got, want)
        compact = whisper_log_mel(fe, audios, 16000, compact=True)  # the kept frames, rebuilt where they are used
        assert compact.shape[-1] < want.shape[-1] and torch.equal(expand_window(compact, want.shape[-1]), want)
        checked += 1
    assert checked == 6


def test_declines_where_only_the_extractor_is_exact():
    fe = WhisperFeatureExtractor(feature_size=80, chunk_length=4)
    near_end = [np.ones(4 * 16000 - 100, np.float32)]  # reaches the end reflection
    assert whisper_log_mel(fe, near_end, 16000) is None
    assert whisper_log_mel(fe, [np.ones(8000, np.float32)], 8000) is None  # the extractor raises on this rate
    assert (
        whisper_log_mel(
            WhisperFeatureExtractor(feature_size=80, chunk_length=4, dither=1.0), [np.ones(8000, np.float32)], 16000
        )
        is None
    )
    padded_otherwise = WhisperFeatureExtractor(feature_size=80, chunk_length=4, padding_value=0.5)
    assert whisper_log_mel(padded_otherwise, [np.ones(8000, np.float32)], 16000) is None  # it pads with 0.5


def _same(a, b):
    assert set(a) == set(b)
    for k in a:
        x, y = a[k], b[k]
        assert type(x) is type(y) and x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(torch.as_tensor(x), torch.as_tensor(y)), k


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(return_tensors="pt"),
        dict(return_attention_mask=True, padding="max_length"),
        dict(return_attention_mask=True, return_tensors="pt"),
        dict(return_tensors="np"),
    ],
)
def test_fast_extractor_call_equals_the_extractors_in_values_and_types(kwargs):
    from dflash_hf.targets.families.whisper_features import FastWhisperFeatureExtractor, with_fast_features

    fe = WhisperFeatureExtractor(feature_size=80, chunk_length=4)
    rng = np.random.default_rng(1)
    audios = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (8000, 20011, 3000)]
    fast = with_fast_features(type("P", (), {"feature_extractor": fe})()).feature_extractor
    assert type(fast) is FastWhisperFeatureExtractor and type(fe) is WhisperFeatureExtractor  # the original untouched
    _same(fast(audios, sampling_rate=16000, **kwargs), fe(audios, sampling_rate=16000, **kwargs))
    _same(fast(audios[0], sampling_rate=16000, **kwargs), fe(audios[0], sampling_rate=16000, **kwargs))  # one clip
    _same(
        fast(audios, sampling_rate=16000, padding="longest", **{k: v for k, v in kwargs.items() if k != "padding"}),
        fe(audios, sampling_rate=16000, padding="longest", **{k: v for k, v in kwargs.items() if k != "padding"}),
    )


def test_very_short_clips_and_the_extractors_own_mask_default():
    fe = WhisperFeatureExtractor(feature_size=80, chunk_length=4)
    rng = np.random.default_rng(3)
    for n in (1, 7, 160, 400, 1000, 1500, 2300):  # the longest clip of the batch under 0.1 s took other kernels
        for batch in ([n], [n, max(1, n // 3)]):
            audios = [rng.standard_normal(m).astype(np.float32) for m in batch]
            assert torch.equal(
                whisper_log_mel(fe, audios, 16000),
                fe(audios, sampling_rate=16000, return_tensors="pt")["input_features"],
            ), batch
    from dflash_hf.targets.families.whisper_features import with_fast_features

    masked = WhisperFeatureExtractor(feature_size=80, chunk_length=4, return_attention_mask=True)
    fast = with_fast_features(type("P", (), {"feature_extractor": masked})()).feature_extractor
    audios = [rng.standard_normal(8000).astype(np.float32)]
    _same(
        fast(audios, sampling_rate=16000, return_tensors="pt"), masked(audios, sampling_rate=16000, return_tensors="pt")
    )


def test_compact_calls_and_the_whole_window_rebuilt_from_them():
    """A compact extractor's plain call gives the kept frames under their own key (a call asking for the mask gets the
    whole window); `with_whole_window` turns them back into `input_features` and refuses a target without a window."""
    fe = WhisperFeatureExtractor(feature_size=80, chunk_length=4)
    processor = type("Processor", (), {"feature_extractor": fe})()
    fast = with_fast_features(processor, compact=True).feature_extractor
    assert not with_fast_features(processor).feature_extractor.compact and processor.feature_extractor is fe
    audios = [np.random.default_rng(1).standard_normal(n).astype(np.float32) for n in (9000, 20000)]
    want = fe(audios, sampling_rate=16000, return_tensors="pt")["input_features"]
    out = fast(audios, sampling_rate=16000, return_tensors="pt")
    assert set(out) == {COMPACT_FEATURES_KEY} and out[COMPACT_FEATURES_KEY].shape[-1] < 400
    whole = with_whole_window({"input_ids": torch.ones(2, 3), **out}, 400)
    assert set(whole) == {"input_ids", "input_features"} and torch.equal(whole["input_features"], want)
    masked = fast(audios, sampling_rate=16000, return_tensors="pt", return_attention_mask=True)
    assert torch.equal(masked["input_features"], want)
    with pytest.raises(ValueError, match="fixed encoder window"):
        with_whole_window(dict(out), None)
    with pytest.raises(ValueError, match="more than the encoder window"):
        expand_window(out[COMPACT_FEATURES_KEY], 10)


@pytest.mark.parametrize("chunk_length", [30, 4])
def test_waves_calls_give_the_extractors_features_where_the_target_computes_them(chunk_length):
    """A waves extractor's plain call gives the padded waves; `with_whole_window` computes their features with the
    standard extractor of the target's mel bins and window: the extractor's own features, bit for bit on the CPU."""
    fe = WhisperFeatureExtractor(feature_size=80, chunk_length=chunk_length)
    fast = with_fast_features(type("P", (), {"feature_extractor": fe})(), compact=True, waves=True).feature_extractor
    rng = np.random.default_rng(5)
    frames = chunk_length * 100
    for _ in range(4):
        seconds = rng.uniform(0.01, 0.7 * chunk_length, size=rng.integers(1, 5))
        audios = [
            rng.standard_normal(max(1, int(x * 16000))).astype(np.float32) * rng.uniform(0.01, 1) for x in seconds
        ]
        out = fast(audios, sampling_rate=16000, return_tensors="pt")
        assert set(out) == {AUDIO_WAVES_KEY} and out[AUDIO_WAVES_KEY].dtype == torch.float32
        assert out[AUDIO_WAVES_KEY].shape[-1] < chunk_length * 16000  # not the whole window's samples
        whole = with_whole_window({"input_ids": torch.ones(1, 2), **out}, frames, 80)
        want = fe(audios, sampling_rate=16000, return_tensors="pt")["input_features"]
        assert set(whole) == {"input_ids", "input_features"} and torch.equal(whole["input_features"], want)
    masked = fast(audios, sampling_rate=16000, return_tensors="pt", return_attention_mask=True)
    assert torch.equal(masked["input_features"], want)  # a call asking for the mask gets the extractor's features
    with pytest.raises(ValueError, match="no standard Whisper extractor"):
        with_whole_window(dict(out), frames, None)


def test_only_the_standard_extractor_of_the_targets_bins_and_window_hands_on_waves():
    assert is_standard_extractor(WhisperFeatureExtractor(feature_size=80), 80, 3000)
    assert is_standard_extractor(WhisperFeatureExtractor(feature_size=128, chunk_length=4), 128, 400)
    assert not is_standard_extractor(WhisperFeatureExtractor(feature_size=80), 128, 3000)  # other mel bins
    assert not is_standard_extractor(WhisperFeatureExtractor(feature_size=80), 80, 400)  # another window
    assert not is_standard_extractor(WhisperFeatureExtractor(feature_size=80), 80, 3050)  # no whole seconds
    assert not is_standard_extractor(WhisperFeatureExtractor(feature_size=80), None, 3000)
    for changed in (
        dict(n_fft=512),
        dict(hop_length=320),
        dict(dither=0.5),
        dict(sampling_rate=8000),
        dict(padding_value=0.5),
    ):
        assert not is_standard_extractor(WhisperFeatureExtractor(feature_size=80, **changed), 80, 3000), changed
    edited = WhisperFeatureExtractor(feature_size=80)
    edited.mel_filters = edited.mel_filters * 1.5  # a bank of its own: the target would compute other features
    assert not is_standard_extractor(edited, 80, 3000)
