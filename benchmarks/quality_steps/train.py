"""``train NAME``: ``dflash-train`` of a named configuration on its data."""

from __future__ import annotations

import time
from pathlib import Path

from .common import cli, run, write_json
from .configs import RunConfig, run_dir
from .fetch import target_dir, text_mask_id
from .labels import check_whisper_conversion, labels_dir, whisper_label_manifests, whisper_labels_current
from .speech import SpeechArgs, build_speech


def train_config(cache: Path, cfg: RunConfig, extra: list[str]) -> Path:
    out = run_dir(cache, cfg.name)
    draft = out / "draft"
    if (draft / "config.json").is_file() and (out / "train_done.json").is_file():
        print(f"{cfg.name}: trained draft exists at {draft}; skipping (delete {out} to retrain)")
        return draft
    target = target_dir(cache, cfg.target)
    if cfg.target == "whisper-base":
        check_whisper_conversion(cache)
        speech = (
            build_speech(cache, SpeechArgs())
            if not (cache / "data" / "speech" / "speech.json").is_file()
            else {n: cache / "data" / "speech" / f"{n}.json" for n in ("train", "dev", "eval")}
        )
        if cfg.generated_labels:
            speech = whisper_label_manifests(cache)
            if not whisper_labels_current(cache):
                raise SystemExit(
                    f"{speech['train']} missing, or made from other clips or another conversion: run "
                    f"`real_targets.py labels {cfg.name}` first"
                )
        data = ["--train_data", speech["train"], "--eval_data", f"dev={speech['dev']}"]
    else:
        cuts = labels_dir(cache, cfg.target) / "train.cuts.jsonl.gz"
        if not cuts.is_file():
            raise SystemExit(f"{cuts} missing: run `real_targets.py labels {cfg.name}` first")
        data = [
            "--train_data",
            cuts,
            "--eval_data",
            f"dev={cuts.with_name('dev.cuts.jsonl.gz')}",
            "--mask_token_id",
            str(text_mask_id(cache, cfg.target)),
        ]
    resume = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    flags = [
        "--target_name_or_path",
        target,
        *data,
        *cfg.train_flags,
        "--output_dir",
        out,
        "--logging_steps",
        "10",
        "--save_steps",
        "250",
        "--save_total_limit",
        "2",
        "--report_to",
        "none",
        "--disable_tqdm",
        "false",
        *(["--resume_from_checkpoint", resume[-1]] if resume else []),
        *extra,
    ]
    start = time.time()
    run([*cli("dflash_hf.cli.train"), *flags])
    write_json(out / "train_done.json", {"seconds": time.time() - start, "flags": [str(f) for f in flags]})
    return draft
