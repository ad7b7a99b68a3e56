"""``eval NAME``: ``dflash-eval`` of a trained configuration, per-slot acceptance and prompt-lookup decoding."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from .common import REPO, RESULTS_DIR, cli, run, tqdm, write_json
from .configs import RunConfig, run_dir
from .fetch import target_dir
from .report import plot_config, training_log


def prompt_inputs_for(cache: Path, cfg: RunConfig, data: Path, num_samples: int):
    """The exact inputs dflash-eval decodes (its own prompt loader)."""
    import itertools

    from transformers import AutoConfig

    from dflash_hf.data.eval_rows import evaluation_prompts, recorded_conversation
    from dflash_hf.targets.processor import load_processor

    target = target_dir(cache, cfg.target)
    conversation = recorded_conversation(None)  # as dflash-eval renders a manifest's rows without flags
    prompts = evaluation_prompts(
        str(data), load_processor(str(target)), AutoConfig.from_pretrained(target), conversation=conversation
    )
    return list(itertools.islice(prompts, num_samples) if num_samples else prompts)


def extra_decoding(
    cache: Path,
    cfg: RunConfig,
    data: Path,
    num_samples: int,
    device: str,
    precision: str,
    lookup_tokens: int,
    acceptance_lengths: list[int] | None = None,
) -> dict:
    """Per-cycle acceptance lengths (for the per-slot histogram) and, for text targets, transformers'
    prompt-lookup decoding on the same prompts, timed like dflash-eval and checked against plain greedy."""
    import torch

    from dflash_hf.export import load_draft_strict
    from dflash_hf.generation.evaluation import DecodeStats, decode_benchmark, synced_clock
    from dflash_hf.targets.frozen import FrozenTarget, load_target, resolve_dtype

    dev = torch.device(device)
    target = FrozenTarget(load_target(str(target_dir(cache, cfg.target)), precision).to(dev))
    draft = load_draft_strict(str(run_dir(cache, cfg.name) / "draft")).to(device=dev, dtype=resolve_dtype(precision))
    prompts = prompt_inputs_for(cache, cfg, data, num_samples)
    if acceptance_lengths is None:  # a JSON of dflash-eval before 2026-12-04 holds totals only: decode once more
        acceptance_lengths = decode_benchmark(
            draft.eval(), target, prompts, cfg.eval_max_new_tokens, compare_greedy=False
        ).acceptance_lengths
    stats = DecodeStats(acceptance_lengths=acceptance_lengths)
    out = {
        "acceptance_lengths": acceptance_lengths,
        "per_slot_acceptance": stats.per_slot_acceptance(draft.config.block_size),
    }
    if cfg.prompt_lookup:
        seconds, tokens, greedy_seconds, greedy_tokens, mismatches = 0.0, 0, 0.0, 0, []
        for i, inputs in enumerate(tqdm(prompts, desc="prompt-lookup")):
            inputs = {k: v.to(dev) for k, v in inputs.items()}
            n = inputs["input_ids"].shape[1]
            kw = dict(max_new_tokens=cfg.eval_max_new_tokens, do_sample=False)
            if i == 0:
                target.model.generate(**inputs, prompt_lookup_num_tokens=lookup_tokens, **kw)
            start = synced_clock(dev)
            lookup = target.model.generate(**inputs, prompt_lookup_num_tokens=lookup_tokens, **kw)[0, n:].tolist()
            seconds += synced_clock(dev) - start
            start = synced_clock(dev)
            greedy = target.model.generate(**inputs, **kw)[0, n:].tolist()
            greedy_seconds += synced_clock(dev) - start
            tokens, greedy_tokens = tokens + len(lookup), greedy_tokens + len(greedy)
            if lookup != greedy:
                mismatches.append(i)
        out["prompt_lookup"] = {
            "num_tokens": lookup_tokens,
            "tokens": tokens,
            "tokens_per_s": tokens / seconds,
            "greedy_tokens_per_s_same_pass": greedy_tokens / greedy_seconds,
            "outputs_identical_to_greedy": not mismatches,
            "mismatched_prompts": mismatches,
        }
    return out


def eval_config(cache: Path, cfg: RunConfig, num_samples: int, device: str, precision: str, lookup_tokens: int) -> Path:
    out_dir = run_dir(cache, cfg.name)
    draft = out_dir / "draft"
    if not (draft / "config.json").is_file():
        raise SystemExit(f"{cfg.name}: no trained draft at {draft}; run `real_targets.py train {cfg.name}` first")
    if cfg.target == "whisper-base":
        data = cache / "data" / "speech" / "eval.json"
    else:
        data = cache / "data" / "prompts" / "eval.jsonl"
    eval_json = out_dir / f"eval_{device.replace(':', '')}_{precision}.json"
    if not eval_json.is_file():
        run(
            [
                *cli("dflash_hf.cli.eval"),
                "--draft",
                draft,
                "--target",
                target_dir(cache, cfg.target),
                "--data",
                data,
                "--max_new_tokens",
                str(cfg.eval_max_new_tokens),
                "--num_samples",
                str(num_samples),
                "--precision",
                precision,
                "--device",
                device,
                "--output_json",
                eval_json,
            ]
        )
    results = json.loads(eval_json.read_text())
    results.update(
        extra_decoding(
            cache, cfg, data, num_samples, device, precision, lookup_tokens, results.get("acceptance_lengths")
        )
    )
    if cfg.prompt_lookup:
        pl = results["prompt_lookup"]
        pl["dflash_vs_prompt_lookup"] = results["spec_tokens_per_s"] / pl["tokens_per_s"]
    train_done = out_dir / "train_done.json"
    results["train"] = json.loads(train_done.read_text()) if train_done.is_file() else None
    results["training_log"] = training_log(out_dir)
    results["commit"] = subprocess.run(
        ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip() or os.environ.get("DFLASH_COMMIT", "")  # no .git
    results["torch_threads"] = __import__("torch").get_num_threads()
    dest = RESULTS_DIR / f"quality_{cfg.name}_{device.split(':')[0]}_{precision}.json"
    write_json(dest, results)
    print(
        f"{cfg.name}: tau {results['tau']:.2f}, speedup {results['speedup']:.2f}x, identical "
        f"{results['outputs_identical']} -> {dest}"
    )
    plot_config(cache, cfg, dest)
    return dest
