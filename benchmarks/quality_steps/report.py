"""``plot`` and ``table``: figures and the markdown table of results files."""

from __future__ import annotations

import json
from pathlib import Path

from .common import FIGURES_DIR
from .configs import RunConfig, run_dir


def training_log(out_dir: Path) -> list[dict]:
    """``log_history`` of the run (the last checkpoint's, or trainer_state.json at the root)."""
    states = sorted(out_dir.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    state = out_dir / "trainer_state.json"
    path = state if state.is_file() else (states[-1] if states else None)
    return json.loads(path.read_text())["log_history"] if path else []


def plot_config(cache: Path, cfg: RunConfig, results_path: Path) -> list[Path]:
    """tau over training steps (tau_est of training and dev, real tau) and the per-slot acceptance histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(results_path.read_text())
    FIGURES_DIR.mkdir(parents=True, exist_ok=True)
    log = results.get("training_log") or training_log(run_dir(cache, cfg.name))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("tau_est", "train tau_est"), ("eval_dev_tau_est", "dev tau_est"), ("eval_dev_tau", "dev tau")):
        pts = [(e["step"], e[key]) for e in log if key in e]
        if pts:
            # dev points are few (one per eval): markers, or a single evaluation draws nothing
            ax.plot(*zip(*pts), marker=None if key == "tau_est" else "o", label=label)
    if log and "tau" in results:  # the held-out decode's real tau, at the last logged step
        ax.plot(
            [max(e.get("step", 0) for e in log)],
            [results["tau"]],
            marker="*",
            markersize=12,
            linestyle="none",
            label=f"real tau ({results.get('prompts', '?')} held out)",
        )
    ax.set(xlabel="optimizer step", ylabel="acceptance length", title=f"{cfg.name}: tau over training")
    if ax.lines:
        ax.legend()
    ax.grid(alpha=0.3)
    tau_png = FIGURES_DIR / f"quality_{cfg.name}_tau.png"
    fig.tight_layout()
    fig.savefig(tau_png, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    slots = results["per_slot_acceptance"]
    ax.bar(range(1, len(slots) + 1), slots)
    ax.set(
        xlabel="draft slot k",
        ylabel="P(slot k accepted)",
        ylim=(0, 1),
        title=f"{cfg.name}: per-slot acceptance (tau {results['tau']:.2f})",
    )
    slot_png = FIGURES_DIR / f"quality_{cfg.name}_slots.png"
    fig.tight_layout()
    fig.savefig(slot_png, dpi=110)
    plt.close(fig)
    return [tau_png, slot_png]


TABLE_COLUMNS = (
    "configuration",
    "device, dtype",
    "prompts",
    "tau",
    "slot 1 / 2 / 4 / 7 accepted",
    "speculative tok/s",
    "greedy tok/s",
    "speedup",
    "prompt lookup tok/s",
    "identical",
)
TABLE_HEADER = "| " + " | ".join(TABLE_COLUMNS) + " |\n|" + " --- |" * len(TABLE_COLUMNS)


def results_table(paths: list[Path]) -> str:
    """Markdown rows of docs/QUALITY.md from results JSON files."""
    rows = [TABLE_HEADER]
    for path in paths:
        r = json.loads(path.read_text())
        slots = r.get("per_slot_acceptance", [])  # dflash-eval's own JSON (a timing run) has none
        picked = " / ".join(f"{slots[k - 1]:.2f}" for k in (1, 2, 4, 7) if k <= len(slots)) or "-"
        pl = r.get("prompt_lookup")
        lookup = "-"
        if pl:
            lookup = f"{pl['tokens_per_s']:.1f}" + ("" if pl["outputs_identical_to_greedy"] else " (differs)")
        rows.append(
            f"| {path.stem.split('_')[1]} | {r['device']}, {r['precision']} | {r['prompts']} | {r['tau']:.2f} "
            f"| {picked} | {r['spec_tokens_per_s']:.1f} | {r['greedy_tokens_per_s']:.1f} | "
            f"{r['speedup']:.2f}x | {lookup} | {'yes' if r['outputs_identical'] else 'NO'} |"
        )
    return "\n".join(rows)
