"""Training curves of a dflash_hf run as PNGs: loss, accuracy, per-slot accuracy, tau_est and real tau.

Reads `trainer_state.json` (its `log_history`; the run directory's own or its latest `checkpoint-*`) and/or
TensorBoard event files (`report_to=tensorboard`) found under the given paths. Writes `loss.png`,
`accuracy.png`, `tau_est.png` and `tau.png` (curves over the step) and `acc_slot.png` (accuracy over the
slot index, one curve per logged step, coloured from early to late, one panel for training and each
validation set), each only when the logs hold such series, into `--out_dir`.

    python scripts/plot_training.py runs/my-draft --out_dir runs/my-draft/plots
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

Series = dict[str, list[tuple[int, float]]]  # name (trainer log key, e.g. "eval_dev_tau_est") -> (step, value)

# figure -> predicate on a log key (train keys bare, eval keys "eval_..."); real tau is "eval_tau" / "eval_{set}_tau"
FIGURES = {
    "loss": lambda k: k == "loss" or (k.startswith("eval_") and k.endswith("_loss")),
    "accuracy": lambda k: k.endswith("accuracy"),
    "tau_est": lambda k: k.endswith("tau_est"),
    "tau": lambda k: k.startswith("eval_") and k.endswith("_tau"),
}


SLOT_KEY = re.compile(r"^(.*?)acc_slot(\d+)$")  # prefix ("" for training, "eval_dev_", ...) and slot index
MAX_SLOT_CURVES = 8  # logged steps drawn per panel (evenly spaced, the last always included)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="run directories, trainer_state.json files or event files")
    parser.add_argument("--out_dir", default=None, help="where the PNGs go (default: <first path>/plots)")
    parser.add_argument(
        "--source",
        choices=("auto", "trainer_state", "tensorboard"),
        default="auto",
        help="auto: trainer_state.json when found, else TensorBoard events",
    )
    return parser


def _latest_trainer_state(path: Path) -> Path | None:
    if path.is_file():
        return path if path.name == "trainer_state.json" else None
    if (path / "trainer_state.json").is_file():
        return path / "trainer_state.json"
    checkpoints = sorted(path.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[-1]))
    return checkpoints[-1] if checkpoints else None


def from_trainer_state(path: Path) -> Series:
    series: Series = defaultdict(list)
    for entry in json.loads(path.read_text())["log_history"]:
        step = int(entry.get("step", 0))
        for key, value in entry.items():
            if key not in ("step", "epoch") and isinstance(value, (int, float)):
                series[key].append((step, float(value)))
    return dict(series)


def _tb_key(tag: str) -> str:
    """TensorBoard tag back to the trainer's log key (`train/loss` -> `loss`, `eval/dev_loss` -> `eval_dev_loss`)."""
    head, _, rest = tag.partition("/")
    return {"train": rest, "eval": f"eval_{rest}"}.get(head, tag)


def from_tensorboard(path: Path) -> Series:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = [path] if path.is_file() else sorted(path.rglob("events.out.tfevents.*"))
    series: Series = defaultdict(list)
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            series[_tb_key(tag)] += [(e.step, e.value) for e in acc.Scalars(tag)]
    return {k: sorted(v) for k, v in series.items()}


def load_series(path: Path, source: str = "auto") -> Series:
    state = _latest_trainer_state(path) if source in ("auto", "trainer_state") else None
    if state is not None:
        return from_trainer_state(state)
    if source == "trainer_state":
        raise FileNotFoundError(f"no trainer_state.json in {path} (nor in a checkpoint-* below it)")
    series = from_tensorboard(path)
    if not series:
        raise FileNotFoundError(
            f"{path} has neither trainer_state.json nor TensorBoard events; train with report_to=tensorboard "
            "or point at the run's output_dir / a checkpoint directory"
        )
    return series


def slot_curves(series: Series, max_curves: int = MAX_SLOT_CURVES) -> dict[str, list[tuple[int, list[float]]]]:
    """Per prefix (training "" or an eval set's "eval_{name}_"): (step, accuracy of slot 1..k) for at most
    `max_curves` logged steps, evenly spaced over the run and always including the last."""
    by_prefix: dict[str, dict[int, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for key, points in series.items():
        match = SLOT_KEY.match(key)
        if match:
            for step, value in points:
                by_prefix[match.group(1)][step][int(match.group(2))] = value
    curves = {}
    for prefix, steps in sorted(by_prefix.items()):
        ordered = sorted(steps)
        if len(ordered) > max_curves:
            picks = {round(i * (len(ordered) - 1) / (max_curves - 1)) for i in range(max_curves)}
            ordered = [ordered[i] for i in sorted(picks)]
        curves[prefix] = [(step, [steps[step][k] for k in sorted(steps[step])]) for step in ordered]
    return curves


def plot_slot_accuracy(series: Series, path: Path) -> bool:
    """`acc_slot.png`: one panel per prefix, accuracy over the slot index, one curve per logged step."""
    curves = slot_curves(series)
    if not curves:
        return False
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), squeeze=False, sharey=True)
    cmap = plt.get_cmap("viridis")
    for ax, (prefix, rows) in zip(axes[0], curves.items()):
        for i, (step, values) in enumerate(rows):
            colour = cmap(i / max(len(rows) - 1, 1))
            ax.plot(range(1, len(values) + 1), values, marker="o", markersize=3, color=colour, label=f"step {step}")
        ax.set_title(prefix.rstrip("_") or "train")
        ax.set_xlabel("slot (1 = first prediction after the anchor)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[0][0].set_ylabel("accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot(series: Series, out_dir: Path) -> list[Path]:
    """One PNG per figure with at least one matching series; returns the written paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, wanted in FIGURES.items():
        keys = sorted(k for k in series if wanted(k) and series[k])
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in keys:
            steps, values = zip(*series[key])
            ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3, label=key)
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", ncol=2 if len(keys) > 8 else 1)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    if plot_slot_accuracy(series, out_dir / "acc_slot.png"):
        written.append(out_dir / "acc_slot.png")
    return written


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    series: Series = {}
    for p in args.paths:
        path = Path(p)
        if not path.exists():
            raise FileNotFoundError(f"{p} does not exist; give a run directory, trainer_state.json or event file")
        for key, points in load_series(path, args.source).items():
            series[key] = sorted(series.get(key, []) + points)
    first = Path(args.paths[0])
    out_dir = Path(args.out_dir) if args.out_dir else (first.parent if first.is_file() else first) / "plots"
    written = plot(series, out_dir)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
