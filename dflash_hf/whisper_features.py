"""Whisper log-mel features without transforming the padding.

`WhisperFeatureExtractor` pads every clip to its 30 s window and runs the STFT, the mel projection and the log over
all 3000 frames, although a frame that lies wholly in the zero padding always comes out the same: mel power 0,
clamped to 1e-10, log10 = -10 (below the clip's maximum, so the maximum and the final clamp are unchanged).
:func:`whisper_log_mel` runs the STFT only over the frames that touch audio (the longest clip of the batch), fills
the rest with that constant, and applies the extractor's own clamp and scaling: the result is bit-identical to
`feature_extractor(audios, sampling_rate=sampling_rate, return_tensors="pt")["input_features"]` (tested over random
lengths), about 10x faster for 7 s clips on one CPU core. It declines (returns None) whenever the shortcut would not
be exact: another extractor class, dither, or audio reaching the window's end (where the STFT's reflection padding
would see it).
"""

from __future__ import annotations

import numpy as np
import torch


def whisper_log_mel(feature_extractor, audios: list[np.ndarray], sampling_rate: int) -> torch.Tensor | None:
    """`[batch, n_mels, frames]` float32 features of mono `audios`, or None when the extractor's own call must be
    used (it also raises on a `sampling_rate` that is not its own)."""
    from transformers import WhisperFeatureExtractor

    fe = feature_extractor
    if type(fe) is not WhisperFeatureExtractor or fe.dither != 0.0 or sampling_rate != fe.sampling_rate or not audios:
        return None
    if any(np.ndim(a) != 1 for a in audios):
        return None
    n, hop, n_fft = fe.n_samples, fe.hop_length, fe.n_fft
    frames = n // hop  # Whisper drops the STFT's last frame
    lengths = [min(len(a), n) for a in audios]
    need = min(frames, -(-(max(lengths) + n_fft // 2) // hop) + 1)  # frames that can touch audio, and one more
    width = (need - 1) * hop + n_fft // 2 + hop  # those frames' samples, clear of the end reflection
    if width >= n - n_fft // 2:
        return None
    wave = np.zeros((len(audios), width), np.float32)
    for row, (a, length) in enumerate(zip(audios, lengths)):
        wave[row, :length] = a[:length]
    stft = torch.stft(torch.from_numpy(wave), n_fft, hop, window=torch.hann_window(n_fft), return_complex=True)
    power = (stft[..., :need].abs() ** 2).contiguous()
    mel = torch.zeros(len(audios), fe.mel_filters.shape[1], frames)
    mel[..., :need] = torch.from_numpy(fe.mel_filters).to(torch.float32).T @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    peak = log_spec.amax(dim=(1, 2), keepdim=True)
    return (torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0


__all__ = ["whisper_log_mel"]
