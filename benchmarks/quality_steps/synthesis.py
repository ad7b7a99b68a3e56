"""Speech synthesis of a sentence: flite and espeak-ng voices, resampling, speed and noise augmentation."""

from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .common import SAMPLING_RATE

TRAIN_VOICES = ("kal", "awb", "rms")
EVAL_VOICE = "slt"
ESPEAK = "espeak:"  # a voice named "espeak:<voice>" is espeak-ng's, any other flite's
# espeak-ng's English accents, each with another of its voice variants (male m1-m7, female f1-f5): `--train_voices
# espeak` takes them all
ESPEAK_VOICES = tuple(
    f"{ESPEAK}{voice}"
    for voice in (
        "en-us+m1",
        "en-us+f2",
        "en-gb+m3",
        "en-gb+f1",
        "en-gb-scotland+m4",
        "en-gb-scotland+f3",
        "en-gb-x-rp+m5",
        "en-gb-x-rp+f4",
        "en-029+m2",
        "en-029+f5",
        "en-gb-x-gbclan+m6",
        "en-gb-x-gbcwmd+m7",
    )
)
VOICE_SETS = {"flite": TRAIN_VOICES, "espeak": ESPEAK_VOICES}


def train_voices(names: list[str]) -> tuple[str, ...]:
    """`--train_voices`: flite voice names, `espeak:<voice>` names, and the sets `flite` / `espeak`; never the
    held-out voice."""
    voices = tuple(v for name in names for v in VOICE_SETS.get(name, (name,)))
    if EVAL_VOICE in voices or not voices:
        raise SystemExit(f"--train_voices {names}: give training voices other than the held-out {EVAL_VOICE!r}")
    return tuple(dict.fromkeys(voices))


def resample(audio: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Band-limited resampling by zero-padding / truncating the spectrum (exact for short clips)."""
    if sr_in == sr_out:
        return audio
    n_out = int(round(len(audio) * sr_out / sr_in))
    spectrum = np.fft.rfft(audio)
    out = np.zeros(n_out // 2 + 1, dtype=spectrum.dtype)
    keep = min(len(spectrum), len(out))
    out[:keep] = spectrum[:keep]
    return (np.fft.irfft(out, n_out) * (n_out / len(audio))).astype(np.float32)


def flite_binary() -> str:
    return os.environ.get("FLITE", "flite")


def espeak_binary() -> str:
    return os.environ.get("ESPEAK_NG", "espeak-ng")


@dataclass(frozen=True)
class Augment:
    """What is done to a synthesized clip: `speed` (resampled as if played `speed` times as fast: shorter, higher,
    as Kaldi's speed perturbation) and white noise at `snr_db` (None: none), drawn from `seed`."""

    speed: float = 1.0
    snr_db: float | None = None
    seed: int = 0

    @property
    def tag(self) -> str:
        """The clip file's suffix: nothing for a plain clip."""
        return (f"-s{self.speed:g}" if self.speed != 1.0 else "") + (
            f"-n{self.snr_db:g}" if self.snr_db is not None else ""
        )

    def apply(self, audio: np.ndarray) -> np.ndarray:
        if self.speed != 1.0:
            audio = resample(audio, int(round(SAMPLING_RATE * self.speed)), SAMPLING_RATE)
        if self.snr_db is not None:
            power = float(np.mean(audio.astype(np.float64) ** 2)) or 1e-10
            noise = np.random.default_rng(self.seed).standard_normal(len(audio))
            audio = audio + (noise * np.sqrt(power / 10 ** (self.snr_db / 10))).astype(np.float32)
        return np.clip(audio, -1.0, 1.0).astype(np.float32)


def augment_for(key: str, seed: int, speeds: tuple[float, ...], noise_fraction: float, snr_db: tuple[float, float]):
    """The clip `key`'s augmentation, fixed by a hash of `key` and `seed` (the same clip always gets the same)."""
    h = int(hashlib.sha1(f"{seed}:{key}".encode()).hexdigest(), 16)
    speed = speeds[h % len(speeds)]
    noisy = (h >> 16) % 10_000 < noise_fraction * 10_000
    snr = round(snr_db[0] + ((h >> 32) % 1001) / 1000 * (snr_db[1] - snr_db[0]), 1) if noisy else None
    return Augment(speed, snr, (h >> 48) % (2**31))


def synthesize(text: str, voice: str, wav: Path, augment: Augment = Augment()) -> np.ndarray:
    """flite's or espeak-ng's `voice` reads `text`, augmented; written to `wav` as 16 kHz PCM; returns the samples."""
    import soundfile as sf

    raw = wav.with_suffix(".raw.wav")
    if voice.startswith(ESPEAK):
        cmd = [espeak_binary(), "-v", voice[len(ESPEAK) :], "-w", str(raw), "--", text]
    else:
        cmd = [flite_binary(), "-voice", voice, "-t", text, "-o", str(raw)]
    subprocess.run(cmd, check=True, capture_output=True)
    audio, sr = sf.read(raw, dtype="float32")
    raw.unlink()
    audio = augment.apply(resample(audio, sr, SAMPLING_RATE))
    sf.write(wav, audio, SAMPLING_RATE, subtype="PCM_16")
    return audio


def synth_job(job: tuple) -> tuple[str, float]:
    text, voice, wav, *augment = job
    path = Path(wav)
    if not path.is_file():
        synthesize(text, voice, path, *augment)
    import soundfile as sf

    return wav, sf.info(path).duration
