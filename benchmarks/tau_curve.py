"""Acceptance length over training minutes: one curve per run (an ablation on one figure), from the runs' logs.

Every log of `dflash-train` holds `train_minutes` (wall clock of the training loop, evaluation and saving included,
summed over resumes) and every evaluation its validation set's real tau (`eval_<set>_tau`: speculative decoding of the
set's first `--real_tau_samples` prompts, `--eval_real_tau`) beside the teacher-forced estimates. This script draws the
real tau of each run over its minutes (solid) with the estimates (dashed: `tau_est`, and the walked greedy estimate,
the selector's for DFlash2), and with `--decode` also decodes each kept checkpoint of every run on `--num_samples`
prompts of `--data` (stars: the real tau of intermediate drafts on clips of your choosing, e.g. held-out ones).

    python benchmarks/tau_curve.py runs/a runs/b --labels "16k clips" "30k clips" --set dev \\
        --out docs/figures/tau_minutes.png
    python benchmarks/tau_curve.py runs/a --decode --target TARGET --data eval.json --num_samples 16 --device cuda

Writes the PNG and a JSON of every point beside it (`--out` with `.json`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ESTIMATES = ("tau_est", "selector_greedy_walk_tau_est", "greedy_walk_tau_est")  # the walk: the selector's if present


def log_history(run: Path) -> list[dict]:
    """The run's `log_history`: its own `trainer_state.json`, else its latest checkpoint's."""
    states = sorted(run.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[-1]))
    path = run / "trainer_state.json" if (run / "trainer_state.json").is_file() else (states[-1] if states else None)
    if path is None:
        raise FileNotFoundError(f"{run}: no trainer_state.json (nor in a checkpoint-* below it); give a run directory")
    return json.loads(path.read_text())["log_history"]


def minutes_at(history: list[dict], step: int) -> float | None:
    """The last `train_minutes` logged at `step` (None when none was: a run logged before the key existed)."""
    found = [e["train_minutes"] for e in history if e.get("step") == step and "train_minutes" in e]
    return max(found) if found else None


def curves(history: list[dict], eval_set: str) -> dict[str, list[tuple[float, float]]]:
    """(minutes, value) of the set's real tau and of its estimates (the first walk estimate the log holds)."""
    prefix = f"eval_{eval_set}_" if eval_set else "eval_"
    out: dict[str, list[tuple[float, float]]] = {}
    walk = next((k for k in ESTIMATES[1:] if any(f"{prefix}{k}" in e for e in history)), None)
    for name in ("tau", "tau_est", *([walk] if walk else [])):
        key = prefix + name
        points = [(e["train_minutes"], e[key]) for e in history if key in e and "train_minutes" in e]
        if points:
            out[name] = sorted(points)
    return out


def decode_checkpoints(runs: list[Path], args) -> dict[str, list[tuple[float, float]]]:
    """Real tau of every kept checkpoint (and the final export, `draft/`) of each run on the first `num_samples` prompts
    of `args.data`: `{run: [(minutes, tau), ...]}`. The target and prompts are loaded once."""
    import torch

    from dflash_hf.export import load_draft_strict
    from dflash_hf.export.evaluation_setup import load_evaluation
    from dflash_hf.generation.evaluation import decode_benchmark
    from dflash_hf.settings.evaluation import EvalSettings
    from dflash_hf.targets.frozen import resolve_dtype

    def checkpoints(run: Path) -> list[tuple[Path, int]]:
        kept = [(p, int(p.name.split("-")[-1])) for p in run.glob("checkpoint-*") if (p / "config.json").is_file()]
        history = log_history(run)
        if (run / "draft" / "config.json").is_file():
            kept.append((run / "draft", max(e.get("step", 0) for e in history)))
        return sorted(kept, key=lambda c: c[1])

    first = next((c for run in runs for c, _ in checkpoints(run)), None)
    if first is None:
        raise SystemExit(f"--decode: no checkpoint-* or draft/ with a config.json under {[str(r) for r in runs]}")
    setup = EvalSettings(
        draft=str(first),
        target=args.target,
        data=args.data,
        num_samples=args.num_samples,
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        precision=args.precision,
    )
    device, target, _, prompts, _ = load_evaluation(setup)
    prompts = list(prompts)
    out = {}
    for run in runs:
        history, points = log_history(run), []
        for path, step in checkpoints(run):
            draft = load_draft_strict(str(path)).to(device=device, dtype=resolve_dtype(args.precision)).eval()
            with torch.no_grad():
                tau = decode_benchmark(draft, target, prompts, args.max_new_tokens, compare_greedy=False).tau
            points.append((minutes_at(history, step), tau, step))
            print(f"{run.name} step {step}: tau {tau:.3f} on {len(prompts)} prompts")
        out[str(run)] = points
    return out


def plot(runs: list[Path], labels: list[str], series: dict, decoded: dict, eval_set: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colours = plt.get_cmap("tab10")
    for i, (run, label) in enumerate(zip(runs, labels)):
        colour = colours(i % 10)
        for name, points in series[str(run)].items():
            style = dict(linestyle="-", marker="o", linewidth=2) if name == "tau" else dict(linestyle="--", alpha=0.6)
            ax.plot(*zip(*points), color=colour, markersize=3, label=f"{label}: {eval_set or 'eval'} {name}", **style)
        stars = [(m, t) for m, t, _ in decoded.get(str(run), []) if m is not None]
        if stars:
            ax.plot(*zip(*stars), "*", color=colour, markersize=11, linestyle="none", label=f"{label}: decoded")
    ax.set(xlabel="training minutes (wall clock of the training loop)", ylabel="acceptance length (tau)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path, nargs="+", help="dflash-train output directories")
    p.add_argument("--labels", nargs="+", default=None, help="one legend name per run (default: the folder names)")
    p.add_argument("--set", default="dev", help="the validation set's name (--eval_data NAME=...; '' for one unnamed)")
    p.add_argument("--out", type=Path, required=True, help="the PNG; its points go to the same name with .json")
    p.add_argument("--decode", action="store_true", help="also decode every kept checkpoint on --data")
    p.add_argument("--target", default=None, help="--decode: the target (Hub id or directory)")
    p.add_argument("--data", default=None, help="--decode: a manifest (or prompts file) as dflash-eval reads")
    p.add_argument("--num_samples", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    labels = args.labels or [r.name for r in args.runs]
    if len(labels) != len(args.runs):
        raise SystemExit(f"--labels: {len(labels)} names for {len(args.runs)} runs")
    if args.decode and not (args.target and args.data):
        raise SystemExit("--decode needs --target and --data (the prompts to decode)")
    series = {str(run): curves(log_history(run), args.set) for run in args.runs}
    empty = [str(r) for r in args.runs if "tau" not in series[str(r)]]
    if empty and not args.decode:
        raise SystemExit(
            f"{empty}: no eval_{args.set}_tau with train_minutes in the log; train with --eval_real_tau true and "
            "--eval_data (or pass --decode to decode the kept checkpoints)"
        )
    decoded = decode_checkpoints(args.runs, args) if args.decode else {}
    plot(args.runs, labels, series, decoded, args.set, args.out)
    points = {
        label: {"curves": series[str(run)], "decoded": decoded.get(str(run), [])}
        for run, label in zip(args.runs, labels)
    }
    args.out.with_suffix(".json").write_text(json.dumps(points, indent=1) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
