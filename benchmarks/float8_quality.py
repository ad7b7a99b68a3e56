"""FP8 training matmuls against the training precision on a real text target (`float8_draft_linears`,
`float8_lm_head`).

    python benchmarks/float8_quality.py --target $CACHE/smollm2/hf --sentences $CACHE/data/corpus/sentences.jsonl \
        --train 3000 --dev 100 --max_steps 300 --out docs/results/float8_quality_smollm2_cpu.json

Two drafts are trained by `dflash-train`, one after the other, from the same seed on the same data in the same order,
one with FP8 (`--fp8`: the draft's linear layers, the lm_head's gradient in the fused CE, or both) and one without;
everything else is equal. The data are corpus sentences as
assistant turns after a fixed user prompt, labelled by the target itself (`label_source=target_argmax`, what
speculative decoding accepts), or the target's own responses (`dflash-generate-labels` output: rows with a
`context`; add `-- --label_source ground_truth`). Reported per run: the dev curve (`eval_dev_tau_est`,
`eval_dev_loss` at each evaluation), the training loss, and the wall time; and the difference of the final dev
tau_est. The target's mask token comes from `converted.json` beside it (`real_targets.py fetch`) or
`--mask_token_id`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from decode_profile_parts.record import git_commit  # noqa: E402
from quality_steps.common import cli, read_jsonl, write_json, write_jsonl  # noqa: E402
from quality_steps.prompts import to_text_cuts  # noqa: E402
from quality_steps.report import training_log  # noqa: E402

PROMPT = "Write one sentence."
FP8_FLAGS = {
    "layers": ("float8_draft_linears",),
    "lm_head": ("float8_lm_head",),
    "both": ("float8_draft_linears", "float8_lm_head"),
}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="a text target: a Hub id or a local directory")
    p.add_argument(
        "--sentences",
        required=True,
        help="JSON lines with a 'text' field (the assistant turn; the corpus' sentences.jsonl) and an "
        "optional 'context' (the user turn, default PROMPT): e.g. dflash-generate-labels' output, "
        "trained on with `-- --label_source ground_truth`",
    )
    p.add_argument("--train", type=int, default=3000, help="training sentences (the first N)")
    p.add_argument("--dev", type=int, default=100, help="dev sentences (the last N)")
    p.add_argument("--max_steps", type=int, default=300)
    p.add_argument("--evals", type=int, default=5, help="evaluations over the run")
    p.add_argument("--mask_token_id", type=int, default=None, help="default: converted.json beside the target")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=2, help="CPU threads of each training process")
    p.add_argument("--work", default="/tmp/float8_quality", help="data and runs go here")
    p.add_argument(
        "--fp8",
        default="layers",
        choices=sorted(FP8_FLAGS),
        help="what the FP8 run converts: layers (float8_draft_linears), lm_head (float8_lm_head) or both",
    )
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("train_flags", nargs="*", help="more dflash-train flags for both runs (after --)")
    return p


def sentence_cuts(sentences: Path, work: Path, n_train: int, n_dev: int) -> dict[str, Path]:
    rows = [r for r in read_jsonl(sentences) if r.get("text", "").strip()]
    if len(rows) < n_train + n_dev:
        raise SystemExit(f"{sentences} has {len(rows)} sentences; --train {n_train} + --dev {n_dev} need more")
    out = {}
    for split, part in (("train", rows[:n_train]), ("dev", rows[len(rows) - n_dev :])):
        manifest = work / f"{split}.jsonl"
        write_jsonl(
            manifest,
            [
                {"id": f"{split}-{i:06d}", "text": r["text"], "context": r.get("context") or PROMPT}
                for i, r in enumerate(part)
            ],
        )
        out[split] = to_text_cuts(manifest, work / f"{split}.cuts.jsonl.gz")
    return out


def train(name: str, args, data: dict[str, Path], mask_id: int, fp8: bool) -> dict:
    out_dir = Path(args.work) / name
    if out_dir.exists():
        shutil.rmtree(out_dir)  # a fresh run, never a resumed one
    flags = [
        "--target_name_or_path",
        args.target,
        "--train_data",
        data["train"],
        "--eval_data",
        f"dev={data['dev']}",
        "--mask_token_id",
        str(mask_id),
        "--output_dir",
        out_dir,
        "--num_draft_layers",
        "1",
        "--block_size",
        "8",
        "--num_anchors",
        "64",
        "--max_tokens",
        "2048",
        "--learning_rate",
        "1e-3",
        "--lr_scheduler_type",
        "cosine",
        "--warmup_steps",
        "20",
        "--max_steps",
        str(args.max_steps),
        "--eval_strategy",
        "steps",
        "--eval_steps",
        str(max(args.max_steps // args.evals, 1)),
        "--logging_steps",
        "10",
        "--save_strategy",
        "steps",
        "--save_steps",
        str(args.max_steps),  # its trainer_state.json: the log
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--seed",
        "0",
        "--precision",
        "bf16" if args.device == "cuda" else "fp32",
        "--real_tau_steps",
        "0",
        "--use_cpu",
        str(args.device == "cpu").lower(),
        *[item for flag in FP8_FLAGS[args.fp8] for item in (f"--{flag}", str(fp8).lower())],
        *args.train_flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [*cli("dflash_hf.cli.train"), *map(str, flags)]
    print("+", " ".join(cmd[3:]), flush=True)
    start = time.time()
    subprocess.run(cmd, check=True, env=env)
    log = training_log(out_dir)
    return {
        **{flag: fp8 for flag in FP8_FLAGS[args.fp8]},
        "seconds": round(time.time() - start, 1),
        "dev": [
            {k: e[k] for k in ("step", "eval_dev_tau_est", "eval_dev_loss") if k in e}
            for e in log
            if "eval_dev_tau_est" in e
        ],
        "train_loss": [(e["step"], e["loss"]) for e in log if "loss" in e],
        "command": " ".join(map(str, flags)),
    }


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    commit = git_commit()  # the tree the runs start from
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    mask_id = args.mask_token_id
    if mask_id is None:
        converted = Path(args.target) / "converted.json"
        if not converted.is_file():
            raise SystemExit(f"no {converted}: pass --mask_token_id")
        mask_id = json.loads(converted.read_text())["mask_token_id"]
    data = sentence_cuts(Path(args.sentences), work, args.train, args.dev)
    runs = {name: train(name, args, data, mask_id, fp8) for name, fp8 in (("reference", False), ("float8", True))}
    final = {name: run["dev"][-1]["eval_dev_tau_est"] for name, run in runs.items() if run["dev"]}
    what = " and ".join(FP8_FLAGS[args.fp8])
    result = {
        "what": f"{what} against the training precision, same seed and data",
        "commit": commit,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "target": args.target,
        "device": args.device,
        "threads": args.threads,
        "train_sentences": args.train,
        "dev_sentences": args.dev,
        "final_dev_tau_est": final,
        "float8_minus_reference": (round(final["float8"] - final["reference"], 4) if len(final) == 2 else None),
        "runs": runs,
    }
    write_json(Path(args.out), result)
    print(json.dumps({k: result[k] for k in ("final_dev_tau_est", "float8_minus_reference")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
