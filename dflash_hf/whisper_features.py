"""Whisper log-mel features without transforming the padding.

`WhisperFeatureExtractor` pads every clip to its 30 s window and runs the STFT, the mel projection and the log over
all 3000 frames, although a frame that lies wholly in the zero padding always comes out the same: mel power 0,
clamped to 1e-10, log10 = -10 (below the clip's maximum, so the maximum and the final clamp are unchanged).
:func:`whisper_log_mel` runs the STFT and the extractor's own clamp, log and scaling only over the frames that touch
audio (the longest clip of the batch) and one padding frame, and fills the rest with that frame's value. The result is
bit-identical to `feature_extractor(audios, sampling_rate=sampling_rate, return_tensors="pt")["input_features"]`
(tested over random lengths with this machine's BLAS; the mel matmul is kept at least `MIN_MATMUL_FRAMES` wide, as
narrower ones took another kernel) and 6-7x faster per bucketed loader batch of real clips (one thread). It declines
(returns None) whenever the shortcut would not be exact: another extractor class, dither, or audio reaching the
window's end (where the STFT's reflection padding would see it).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from transformers import BatchFeature, WhisperFeatureExtractor

MIN_MATMUL_FRAMES = 16


def whisper_log_mel(feature_extractor, audios: list[np.ndarray], sampling_rate: int) -> torch.Tensor | None:
    """`[batch, n_mels, frames]` float32 features of mono `audios`, or None when the extractor's own call must be
    used (it also raises on a `sampling_rate` that is not its own)."""
    fe = feature_extractor
    exact_class = type(fe) in (WhisperFeatureExtractor, FastWhisperFeatureExtractor)  # not other subclasses
    if not exact_class or fe.dither != 0.0 or sampling_rate != fe.sampling_rate or not audios:
        return None
    if any(np.ndim(a) != 1 for a in audios):
        return None
    n, hop, n_fft = fe.n_samples, fe.hop_length, fe.n_fft
    frames = n // hop  # Whisper drops the STFT's last frame
    lengths = [min(len(a), n) for a in audios]
    need = min(frames, -(-(max(lengths) + n_fft // 2) // hop) + 1)  # frames that can touch audio, and one more
    # those frames' samples (at least MIN_MATMUL_FRAMES of them), clear of the end reflection
    width = (max(need, MIN_MATMUL_FRAMES) - 1) * hop + n_fft // 2 + hop
    if width >= n - n_fft // 2:
        return None
    wave = np.zeros((len(audios), width), np.float32)
    for row, (a, length) in enumerate(zip(audios, lengths)):
        wave[row, :length] = a[:length]
    stft = torch.stft(torch.from_numpy(wave), n_fft, hop, window=torch.hann_window(n_fft), return_complex=True)
    # at least MIN_MATMUL_FRAMES columns: a narrower mel matmul took another BLAS kernel and differed by 1 ulp
    cols = min(frames, max(need, MIN_MATMUL_FRAMES), stft.shape[-1])
    power = (stft[..., :cols].abs() ** 2).contiguous()
    # the computed frames and, where the window is padded, one all-padding frame (mel power 0): the log, the peak and
    # the scaling run over these only, and the padding frame's value (the same in every padding frame) fills the rest
    kept = min(frames, cols + 1)
    mel = torch.zeros(len(audios), fe.mel_filters.shape[1], kept)
    mel[..., :cols] = torch.from_numpy(fe.mel_filters).to(torch.float32).T @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    peak = log_spec.amax(dim=(1, 2), keepdim=True)
    log_spec = (torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0  # [batch, n_mels, kept]
    out = log_spec[..., -1:].expand(-1, -1, frames).contiguous()  # (with no padding frame, all overwritten below)
    out[..., :kept] = log_spec
    return out


def frame_mask(feature_extractor, lengths: list[int]) -> np.ndarray:
    """`[batch, frames]` int32 frame mask as `WhisperFeatureExtractor(..., return_attention_mask=True)` returns it:
    the sample mask of the padded window taken every `hop_length` samples (trimmed to the kept frames)."""
    fe = feature_extractor
    n, hop = fe.n_samples, fe.hop_length
    samples = np.arange(0, n, hop)  # the sample each kept frame starts at
    if n % hop:
        samples = samples[:-1]
    return (samples[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)


class FastWhisperFeatureExtractor(WhisperFeatureExtractor):
    """`WhisperFeatureExtractor` whose call computes its features with :func:`whisper_log_mel` when the call is one
    the shortcut reproduces exactly (a batch of mono arrays padded to the window, at the extractor's rate, no
    normalization, on the CPU); any other call is the extractor's own. For processors that call their extractor
    internally (Qwen2-Audio, AudioFlamingo3, GLM-ASR): see :func:`with_fast_features`."""

    def __call__(self, raw_speech, truncation: bool = True, pad_to_multiple_of=None, return_tensors=None,
                 return_attention_mask=None, padding="max_length", max_length=None, sampling_rate=None,
                 do_normalize=None, device="cpu", **kwargs):
        audios = raw_speech if isinstance(raw_speech, (list, tuple)) else [raw_speech]
        # an unset return_attention_mask with the extractor's default on returns a sample-level mask: theirs only
        default_mask = return_attention_mask is None and self.return_attention_mask
        plain = (not default_mask and truncation and pad_to_multiple_of is None and padding == "max_length"
                 and not do_normalize and max_length in (None, self.n_samples) and device in (None, "cpu")
                 and not kwargs and sampling_rate == self.sampling_rate and return_tensors in (None, "pt", "np")
                 and all(isinstance(a, np.ndarray) and a.ndim == 1 for a in audios))
        features = whisper_log_mel(self, list(audios), sampling_rate) if plain else None
        if features is None:
            return super().__call__(raw_speech, truncation=truncation, pad_to_multiple_of=pad_to_multiple_of,
                                    return_tensors=return_tensors, return_attention_mask=return_attention_mask,
                                    padding=padding, max_length=max_length, sampling_rate=sampling_rate,
                                    do_normalize=do_normalize, device=device, **kwargs)
        out = {"input_features": features.numpy()}
        if return_attention_mask:
            out["attention_mask"] = frame_mask(self, [min(len(a), self.n_samples) for a in audios])
        return BatchFeature(out).convert_to_tensors(return_tensors) if return_tensors else BatchFeature(out)


def with_fast_features(processor):
    """`processor` itself, or a shallow copy whose Whisper feature extractor is a :class:`FastWhisperFeatureExtractor`
    with the same settings (outputs unchanged, tested per family); the caller's processor is not modified."""
    fe = getattr(processor, "feature_extractor", None)
    if type(fe) is not WhisperFeatureExtractor:
        return processor
    fast = FastWhisperFeatureExtractor.__new__(FastWhisperFeatureExtractor)
    fast.__dict__.update(fe.__dict__)
    processor = copy.copy(processor)
    processor.feature_extractor = fast
    return processor


__all__ = ["FastWhisperFeatureExtractor", "frame_mask", "whisper_log_mel", "with_fast_features"]
