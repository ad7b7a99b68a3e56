"""``data speech`` and ``revoice``: synthetic speech manifests of the corpus sentences."""

from __future__ import annotations

import concurrent.futures
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from .common import read_jsonl, stamp_ok, tqdm, write_jsonl, write_stamp
from .corpus import build_corpus
from .synthesis import ESPEAK, EVAL_VOICE, TRAIN_VOICES, Augment, augment_for, synth_job


@dataclass
class SpeechArgs:
    train: int = 3000
    eval: int = 200
    dev: int = 64
    min_seconds: float = 3.0
    max_seconds: float = 20.0
    workers: int = 2
    seed: int = 0
    voices: tuple[str, ...] = TRAIN_VOICES  # training voices (`train_voices`); dev and eval are always slt
    speeds: tuple[float, ...] = (1.0,)  # training clips' speed factors, one per clip by a hash of it
    noise_fraction: float = 0.0  # training clips with white noise added
    snr_db: tuple[float, float] = (10.0, 30.0)  # their signal-to-noise ratio, uniform in this range

    def settings(self) -> dict:
        """What decides the clips besides the counts (recorded in the stamp: other settings build anew)."""
        return {
            "voices": list(self.voices),
            "speeds": list(self.speeds),
            "noise_fraction": self.noise_fraction,
            "snr_db": list(self.snr_db),
            "seed": self.seed,
        }


def build_speech(cache: Path, a: SpeechArgs) -> dict[str, Path]:
    """Synthetic speech of corpus sentences: train (the training voices, flite kal/awb/rms by default, espeak-ng's
    with `--train_voices espeak`; train sentences; speed and noise augmentation as asked), dev and eval (flite slt,
    held-out sentences, never augmented). NeMo manifests with paths relative to them; clips outside [min, max] s are
    replaced by further sentences (counted in speech.json, never silently)."""
    corpus = read_jsonl(build_corpus(cache))
    root = cache / "data" / "speech"
    manifests = {name: root / f"{name}.json" for name in ("train", "dev", "eval")}
    stamp = root / "speech.json"
    wanted = {"train": a.train, "dev": a.dev, "eval": a.eval}
    if stamp_ok(stamp):
        done = json.loads(stamp.read_text())
        if done["counts"] == wanted and done.get("settings", SpeechArgs().settings()) == a.settings():
            return manifests
    rng = random.Random(a.seed)
    pools = {s: [r for r in corpus if r["split"] == s] for s in ("train", "eval")}
    for pool in pools.values():
        rng.shuffle(pool)
    plan = {
        "train": (pools["train"], a.voices),
        "dev": (pools["eval"][: len(pools["eval"]) // 2], (EVAL_VOICE,)),
        "eval": (pools["eval"][len(pools["eval"]) // 2 :], (EVAL_VOICE,)),
    }
    report = {}
    start = time.time()
    with concurrent.futures.ProcessPoolExecutor(a.workers) as pool:
        for name, (sentences, voices) in plan.items():
            rows, out_of_range, cursor = [], 0, 0
            bar = tqdm(total=wanted[name], desc=f"speech {name}", unit="utt")
            while len(rows) < wanted[name]:
                need = wanted[name] - len(rows)
                batch = sentences[cursor : cursor + need]
                if not batch:
                    raise RuntimeError(
                        f"speech {name}: only {len(rows)} clips within [{a.min_seconds}, "
                        f"{a.max_seconds}] s from {len(sentences)} sentences; ask for fewer"
                    )
                jobs = []
                for k, r in enumerate(batch, start=cursor):
                    voice = voices[k % len(voices)]
                    aug = Augment()
                    if name == "train":
                        aug = augment_for(f"{voice}/{r['id']}", a.seed, a.speeds, a.noise_fraction, a.snr_db)
                    folder = voice.replace(":", "-")
                    jobs.append((r["text"], voice, str(root / "wav" / folder / f"{r['id']}{aug.tag}.wav"), aug))
                for job in jobs:
                    Path(job[2]).parent.mkdir(parents=True, exist_ok=True)
                cursor += len(batch)
                for (text, voice, wav, aug), (_, duration) in zip(jobs, pool.map(synth_job, jobs, chunksize=8)):
                    if a.min_seconds <= duration <= a.max_seconds:
                        rows.append(
                            {
                                "audio_filepath": str(Path(wav).relative_to(root)),
                                "duration": round(duration, 3),
                                "text": text,
                                "lang": "en",
                                "id": f"{name}-{Path(wav).stem}-{voice.replace(':', '-')}",
                                "speaker": voice,
                                **({"speed": aug.speed} if aug.speed != 1.0 else {}),
                                **({"snr_db": aug.snr_db} if aug.snr_db is not None else {}),
                            }
                        )
                        bar.update(1)
                    else:
                        out_of_range += 1
            bar.close()
            write_jsonl(manifests[name], rows)
            report[name] = {
                "clips": len(rows),
                "out_of_range": out_of_range,
                "voices": list(voices),
                "hours": round(sum(r["duration"] for r in rows) / 3600, 3),
            }
            print(f"speech {name}: {report[name]}")
    report["seconds"] = round(time.time() - start, 1)
    write_stamp(stamp, list(manifests.values()), counts=wanted, settings=a.settings(), report=report)
    return manifests


def revoice(manifest: Path, voices: list[str], out: Path, workers: int = 2) -> Path:
    """The sentences of a speech manifest read again by other flite voices (the voice-gap check of docs/QUALITY.md: the
    held-out sentences in the training voices). Every row is kept, whatever its duration; the new manifest (paths
    relative to `out`) is `out/<manifest stem>-<voices>.json`."""
    known = (*TRAIN_VOICES, EVAL_VOICE)
    unknown = [v for v in voices if v not in known and not v.startswith(ESPEAK)]
    if unknown or not voices:
        raise SystemExit(f"--voices {unknown or voices}: choose from {list(known)} or espeak:<espeak-ng voice>")
    rows = read_jsonl(manifest)
    pairs = [(r, v) for r in rows for v in voices]
    jobs = [
        (r["text"], v, str(out / "wav" / v.replace(":", "-") / f"{Path(r['audio_filepath']).stem}.wav"))
        for r, v in pairs
    ]
    for v in voices:
        (out / "wav" / v.replace(":", "-")).mkdir(parents=True, exist_ok=True)
    new = []
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        done = tqdm(pool.map(synth_job, jobs, chunksize=4), total=len(jobs), desc="revoice", unit="utt")
        for (r, voice), (wav, duration) in zip(pairs, done):
            new.append(
                {
                    **r,
                    "audio_filepath": str(Path(wav).relative_to(out)),
                    "duration": round(duration, 3),
                    "id": f"{r['id']}-as-{voice}",
                    "speaker": voice,
                }
            )
    dest = out / f"{manifest.stem}-{'-'.join(voices)}.json"
    write_jsonl(dest, new)
    return dest
