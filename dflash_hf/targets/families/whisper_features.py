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

Compact features (the training collator of Whisper targets): the same values over the kept frames only, under
`COMPACT_FEATURES_KEY`, their last frame the padding frame wherever the window is padded. `expand_window` rebuilds the
window from them on the target's device (bit-identical): the loader no longer writes, moves between processes and
copies to the GPU the window's repeated padding (a batch of 64 utterances of 2 s: 57 of its 61 MB).

Device features (the trainer's Whisper loaders on a CUDA device, where the processor's extractor is the standard
one of the target's `num_mel_bins` and window): the collator gives the padded waves instead (`AUDIO_WAVES_KEY`,
`padded_waves`, float32) and the frozen target computes the features on its device (`log_mel_of_waves`):
the loader then only reads audio. The log-mel of a batch of 64 clips of 5-20 s took about 19 ms a clip on one CPU
core here (1.2 s a batch), while a Whisper-base training step of such a batch takes 57-70 ms on one GPU.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import torch
from transformers import BatchFeature, WhisperFeatureExtractor

from dflash_hf.targets.families.base import HOP_LENGTH, SAMPLING_RATE

MIN_MATMUL_FRAMES = 16
COMPACT_FEATURES_KEY = "input_features_compact"  # `[batch, n_mels, kept]`: `expand_window` gives `input_features`
AUDIO_WAVES_KEY = "input_audio_waves"  # `[batch, width]` float32 (`padded_waves`): `log_mel_of_waves` on the device


def whisper_log_mel(
    feature_extractor, audios: list[np.ndarray], sampling_rate: int, compact: bool = False
) -> torch.Tensor | None:
    """`[batch, n_mels, frames]` float32 features of mono `audios`, or None when the extractor's own call must be
    used (it also raises on a `sampling_rate` that is not its own). `compact`: only the kept frames,
    `[batch, n_mels, kept]`, whose last one is the padding frame where `kept < frames` (`expand_window`)."""
    wave = padded_waves(feature_extractor, audios, sampling_rate)
    if wave is None:
        return None
    log_spec = log_mel_of_waves(feature_extractor, torch.from_numpy(wave))
    return log_spec if compact else expand_window(log_spec, feature_extractor.n_samples // feature_extractor.hop_length)


def padded_waves(feature_extractor, audios: list[np.ndarray], sampling_rate: int) -> np.ndarray | None:
    """`[batch, width]` float32: `audios` zero-padded to the samples that the frames touching audio need (at least
    `MIN_MATMUL_FRAMES` frames' worth, clear of the window's end reflection), `log_mel_of_waves`' input; None where
    the shortcut would not be exact (`whisper_log_mel`: another class, dither, a padding value other than 0, another
    rate, audio reaching the window's end)."""
    fe = feature_extractor
    if not _exact(fe) or sampling_rate != fe.sampling_rate or not audios or any(np.ndim(a) != 1 for a in audios):
        return None
    n, hop, n_fft = fe.n_samples, fe.hop_length, fe.n_fft
    lengths = [min(len(a), n) for a in audios]
    need = min(n // hop, -(-(max(lengths) + n_fft // 2) // hop) + 1)  # frames that can touch audio, and one more
    width = (max(need, MIN_MATMUL_FRAMES) - 1) * hop + n_fft // 2 + hop
    if width >= n - n_fft // 2:
        return None
    wave = np.zeros((len(audios), width), np.float32)
    for row, (a, length) in enumerate(zip(audios, lengths)):
        wave[row, :length] = a[:length]
    return wave


def log_mel_of_waves(feature_extractor, wave: torch.Tensor, filters: torch.Tensor | None = None) -> torch.Tensor:
    """Compact features `[batch, n_mels, kept]` of `padded_waves`' output (only that: the frame after the computed
    ones must be padding), computed where `wave` is (the frames follow from its width). On the CPU bit-identical to
    the extractor's; on a CUDA GPU the mel projection runs in float64, so that no TF32 setting rounds it (the
    features then differ from the CPU's by float rounding only). `filters`: the extractor's mel filters already
    where `wave` is (`_filters_on`; a copy each call would wait)."""
    fe = feature_extractor
    n, hop, n_fft = fe.n_samples, fe.hop_length, fe.n_fft
    frames = n // hop  # Whisper drops the STFT's last frame
    stft = torch.stft(wave, n_fft, hop, window=torch.hann_window(n_fft, device=wave.device), return_complex=True)
    # at least MIN_MATMUL_FRAMES columns: a narrower mel matmul took another BLAS kernel and differed by 1 ulp
    cols = min(frames, (wave.shape[-1] - n_fft // 2 - hop) // hop + 1, stft.shape[-1])
    power = (stft[..., :cols].abs() ** 2).contiguous()
    # the computed frames and, where the window is padded, one all-padding frame (mel power 0): the log, the peak and
    # the scaling run over these only, and the padding frame's value (the same in every padding frame) fills the rest
    kept = min(frames, cols + 1)
    mel = torch.zeros(wave.shape[0], fe.mel_filters.shape[1], kept, device=wave.device)
    if filters is None:
        filters = _mel_projection(fe.mel_filters, wave.device)
    mel[..., :cols] = (filters @ power.to(filters.dtype)).to(torch.float32)
    log_spec = torch.clamp(mel, min=1e-10).log10()
    peak = log_spec.amax(dim=(1, 2), keepdim=True)
    return (torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0  # [batch, n_mels, kept]


def expand_window(features: torch.Tensor, frames: int) -> torch.Tensor:
    """`[batch, n_mels, frames]` from compact features `[batch, n_mels, kept]` (`whisper_log_mel(compact=True)`): the
    last kept frame (the padding frame) repeated over the rest of the window. Runs where the features are (a GPU)."""
    kept = features.shape[-1]
    if kept > frames:
        raise ValueError(f"compact features hold {kept} frames, more than the encoder window's {frames}")
    if kept == frames:
        return features
    return torch.cat([features, features[..., -1:].expand(-1, -1, frames - kept)], dim=-1)


def with_whole_window(batch: dict, frames: int | None, num_mel_bins: int | None = None) -> dict:
    """`batch` with its compact features (`COMPACT_FEATURES_KEY`) or padded waves (`AUDIO_WAVES_KEY`, whose
    features the standard extractor of `num_mel_bins` mels and that window computes where they are) rebuilt as the
    encoder's whole window of `frames`, `input_features`; `frames` None: a target without a fixed window."""
    key = next((k for k in (COMPACT_FEATURES_KEY, AUDIO_WAVES_KEY) if k in batch), None)
    if key is None:
        return batch
    if not frames:
        raise ValueError(
            f"the batch holds {key!r}, which only a target with a fixed encoder window (Whisper) takes; "
            "build its loader with compact_features=False and device_features=False"
        )
    out = {k: v for k, v in batch.items() if k != key}
    features = batch[key]
    if key == AUDIO_WAVES_KEY:
        extractor = standard_extractor(num_mel_bins, frames) if num_mel_bins else None
        if extractor is None:
            raise ValueError(
                f"the batch holds {key!r}, but the target (num_mel_bins={num_mel_bins}, a window of "
                f"{frames} frames) has no standard Whisper extractor to compute their features with; "
                "build its loader with device_features=False"
            )
        features = log_mel_of_waves(extractor, features, _filters_on(num_mel_bins, frames, features.device))
    out["input_features"] = expand_window(features, frames)
    return out


def _mel_projection(mel_filters: np.ndarray, device: torch.device) -> torch.Tensor:
    """`[n_mels, n_freqs]`: float32 on the CPU (the extractor's own arithmetic), float64 on a CUDA device."""
    return torch.from_numpy(mel_filters).to(device, torch.float64 if device.type == "cuda" else torch.float32).T


@functools.lru_cache(maxsize=8)
def _filters_on(num_mel_bins: int, frames: int, device: torch.device) -> torch.Tensor:
    """The standard extractor's `_mel_projection` on `device`, copied there once."""
    return _mel_projection(standard_extractor(num_mel_bins, frames).mel_filters, device)


@functools.cache
def standard_extractor(num_mel_bins: int, frames: int) -> WhisperFeatureExtractor | None:
    """Whisper's feature extractor with its defaults (16 kHz, hop 160, n_fft 400), `num_mel_bins` mels and a window of
    `frames` (Whisper's 3000: 30 s); None for a window that is no whole number of seconds."""
    seconds, rest = divmod(frames * HOP_LENGTH, SAMPLING_RATE)
    return None if rest or not seconds else WhisperFeatureExtractor(feature_size=num_mel_bins, chunk_length=seconds)


def is_standard_extractor(feature_extractor, num_mel_bins: int | None, frames: int) -> bool:
    """Whether `feature_extractor` computes what `standard_extractor(num_mel_bins, frames)` does on the device (its
    settings and mel filters equal, no dither): only then may a loader hand on waves instead of features."""
    fe = feature_extractor
    ref = standard_extractor(num_mel_bins, frames) if num_mel_bins and _exact(fe) else None
    same = ("feature_size", "sampling_rate", "hop_length", "n_fft", "n_samples", "nb_max_frames")
    return (
        ref is not None
        and all(getattr(fe, k) == getattr(ref, k) for k in same)
        and np.array_equal(fe.mel_filters, ref.mel_filters)
    )


def _exact(feature_extractor) -> bool:
    """Whether this module's log-mel reproduces `feature_extractor` exactly: its own class (not a subclass), no
    dither, zero padding."""
    fe = feature_extractor
    return (
        type(fe) in (WhisperFeatureExtractor, FastWhisperFeatureExtractor)
        and fe.dither == 0.0
        and (fe.padding_value == 0.0)
    )


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
    internally (Qwen2-Audio, AudioFlamingo3, GLM-ASR): see :func:`with_fast_features`. With `compact` set, such a
    call returns the compact features under `COMPACT_FEATURES_KEY` instead (for a caller that expands them); with
    `waves` set, the padded waves under `AUDIO_WAVES_KEY` (for a caller that computes their features)."""

    compact: bool = False
    waves: bool = False

    def __call__(
        self,
        raw_speech,
        truncation: bool = True,
        pad_to_multiple_of=None,
        return_tensors=None,
        return_attention_mask=None,
        padding="max_length",
        max_length=None,
        sampling_rate=None,
        do_normalize=None,
        device="cpu",
        **kwargs,
    ):
        audios = raw_speech if isinstance(raw_speech, (list, tuple)) else [raw_speech]
        # an unset return_attention_mask with the extractor's default on returns a sample-level mask: theirs only
        default_mask = return_attention_mask is None and self.return_attention_mask
        plain = (
            not default_mask
            and truncation
            and pad_to_multiple_of is None
            and padding == "max_length"
            and not do_normalize
            and max_length in (None, self.n_samples)
            and device in (None, "cpu")
            and not kwargs
            and sampling_rate == self.sampling_rate
            and return_tensors in (None, "pt", "np")
            and all(isinstance(a, np.ndarray) and a.ndim == 1 for a in audios)
        )
        compact = self.compact and not return_attention_mask
        if plain and self.waves and not return_attention_mask:
            wave = padded_waves(self, list(audios), sampling_rate)
            if wave is not None:
                out = BatchFeature({AUDIO_WAVES_KEY: wave})
                return out.convert_to_tensors(return_tensors) if return_tensors else out
        features = whisper_log_mel(self, list(audios), sampling_rate, compact=compact) if plain else None
        if features is None:
            return super().__call__(
                raw_speech,
                truncation=truncation,
                pad_to_multiple_of=pad_to_multiple_of,
                return_tensors=return_tensors,
                return_attention_mask=return_attention_mask,
                padding=padding,
                max_length=max_length,
                sampling_rate=sampling_rate,
                do_normalize=do_normalize,
                device=device,
                **kwargs,
            )
        out = {COMPACT_FEATURES_KEY if compact else "input_features": features.numpy()}
        if return_attention_mask:
            out["attention_mask"] = frame_mask(self, [min(len(a), self.n_samples) for a in audios])
        return BatchFeature(out).convert_to_tensors(return_tensors) if return_tensors else BatchFeature(out)


def with_fast_features(processor, compact: bool = False, waves: bool = False):
    """`processor` itself, or a shallow copy whose Whisper feature extractor is a :class:`FastWhisperFeatureExtractor`
    with the same settings (outputs unchanged, tested per family); the caller's processor is not modified.
    `compact` / `waves`: its plain calls return compact features or padded waves (`FastWhisperFeatureExtractor`)."""
    fe = getattr(processor, "feature_extractor", None)
    if type(fe) is not WhisperFeatureExtractor:
        return processor
    fast = FastWhisperFeatureExtractor.__new__(FastWhisperFeatureExtractor)
    fast.__dict__.update(fe.__dict__)
    fast.compact, fast.waves = compact, waves
    processor = copy.copy(processor)
    processor.feature_extractor = fast
    return processor


__all__ = [
    "AUDIO_WAVES_KEY",
    "COMPACT_FEATURES_KEY",
    "FastWhisperFeatureExtractor",
    "expand_window",
    "frame_mask",
    "is_standard_extractor",
    "log_mel_of_waves",
    "padded_waves",
    "standard_extractor",
    "whisper_log_mel",
    "with_fast_features",
    "with_whole_window",
]
