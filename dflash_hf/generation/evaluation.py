"""Decoding evaluation (docs/EVALUATION.md): greedy speculative decoding of prompts against the target's own greedy
`generate` on the same prompts (:func:`decode_benchmark`): real tau, tokens/s of both, target forwards, and whether
the outputs are identical (:class:`DecodeStats`), optionally with tree verification beside the chain.

The prompts are target inputs of one prompt each (plain dicts of tensors); `dflash_hf.data.eval_rows` makes them from
a manifest or a validation set, `dflash_hf.data.text_prompts` from JSON lines of text prompts.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from tqdm.auto import tqdm

from dflash_hf.generation.decode_options import DecodeOptions
from dflash_hf.generation.speculative import speculative_generate
from dflash_hf.generation.target_generate import generate_inputs, target_generate, target_generate_new_tokens
from dflash_hf.generation.tree_verify import check_tree_target
from dflash_hf.targets.frozen import FrozenTarget, TargetModel


@dataclass
class DecodeStats:
    """Totals over prompts. tau is the mean over all draft/verify cycles of accepted tokens + 1."""

    prompts: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    spec_tokens: int = 0
    spec_seconds: float = 0.0
    greedy_tokens: int = 0
    greedy_seconds: float = 0.0
    mismatches: list[int] = field(default_factory=list)  # indices of prompts whose outputs differ
    compared: bool = False
    draft_steps: dict[str, int] = field(default_factory=dict)  # prompts per way the draft's step ran
    verify_steps: dict[str, int] = field(default_factory=dict)  # and the target's verify
    target_forwards: int = 0  # the target's forwards of the speculative decodes (prompts' included)
    trees: dict[int, DecodeStats] = field(default_factory=dict)  # tree verification per budget, on the same prompts

    @property
    def tau(self) -> float:
        """NaN when no cycle ran (every prompt ended at its first token)."""
        n = len(self.acceptance_lengths)
        return sum(self.acceptance_lengths) / n if n else float("nan")

    def per_slot_acceptance(self, block_size: int) -> list[float]:
        """Fraction of cycles whose drafted slot k (1-based, k < block_size) was accepted: P(acceptance length > k)."""
        n = max(len(self.acceptance_lengths), 1)
        return [sum(a > k for a in self.acceptance_lengths) / n for k in range(1, block_size)]

    def as_dict(self) -> dict:
        out = {
            "prompts": self.prompts,
            "cycles": len(self.acceptance_lengths),
            "tau": self.tau,
            "acceptance_lengths": list(self.acceptance_lengths),
            "spec_tokens": self.spec_tokens,
            "spec_tokens_per_s": self.spec_tokens / max(self.spec_seconds, 1e-9),
            "draft_steps": dict(self.draft_steps),
            "verify_steps": dict(self.verify_steps),
            "target_forwards": self.target_forwards,
        }
        if self.compared:
            greedy_tps = self.greedy_tokens / max(self.greedy_seconds, 1e-9)
            out.update(
                greedy_tokens=self.greedy_tokens,
                greedy_tokens_per_s=greedy_tps,
                speedup=out["spec_tokens_per_s"] / max(greedy_tps, 1e-9),
                outputs_identical=not self.mismatches,
                mismatched_prompts=list(self.mismatches),
            )
        if self.trees:  # each budget's figures; its speedup against the same greedy decodes
            out["tree"] = {str(budget): tree.as_dict() for budget, tree in self.trees.items()}
        return out


def synced_clock(device: torch.device) -> float:
    """`time.perf_counter()` after the device's queued work (a CUDA synchronize): wall time of what ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def decode_benchmark(
    draft: nn.Module,
    target: TargetModel,
    prompts: Iterable[dict],
    max_new_tokens: int,
    *,
    compare_greedy: bool = True,
    warmup: bool = True,
    progress: bool = False,
    total: int | None = None,
    options: DecodeOptions | None = None,
    tree_budgets: Sequence[int] = (),
    draft_cuda_graph: bool | None = None,
    verify_cuda_graph: bool | None = None,
) -> DecodeStats:
    """Greedy speculative decoding of every prompt (target inputs of one prompt each). With
    `compare_greedy`, the target's own `generate(do_sample=False)` decodes the same prompt and the two
    outputs must be token-identical (a mismatch is recorded, not raised). `warmup` decodes the first prompt
    once untimed (kernel and allocator start-up, and the CUDA graph captures). `options`: how the draft's step and
    the target's verify run (`DecodeOptions`; default: where they can run). `tree_budgets`: after the chain's pass,
    one pass over the same prompts per budget with tree verification (`options.with_tree(budget)`; its own untimed
    warm-up: each budget captures its own fixed-shape steps), compared with the chain pass's greedy decodes; their
    figures are the returned stats' `trees`. A budget or a target that tree verification cannot take is refused
    before any decoding. `draft_cuda_graph` / `verify_cuda_graph`: the two step modes as keywords, instead of
    `options` (as `speculative_generate` takes them)."""
    options = DecodeOptions.of(options, draft_cuda_graph, verify_cuda_graph)
    if options.tree_budget is not None:
        raise ValueError(
            f"decode_benchmark: options.tree_budget={options.tree_budget}, but its first pass verifies the chain; "
            f"pass the budget as tree_budgets=[{options.tree_budget}] (a tree pass beside the chain's)"
        )
    ft = FrozenTarget.of(target)
    tree_options = [(budget, options.with_tree(budget)) for budget in tree_budgets]  # each budget checked there
    if tree_options:
        check_tree_target(ft)
    device = ft.device
    stats = DecodeStats(compared=compare_greedy)
    kept: list[tuple[dict, int, list[int] | None, float]] = []  # the tree passes' prompts (host) and greedy decodes

    def decode(inputs, run_options=options):
        return speculative_generate(draft, ft, max_new_tokens, options=run_options, **inputs)

    for i, prompt in enumerate(tqdm(prompts, total=total, disable=not progress, desc="dflash-eval")):
        n_prompt = prompt["input_ids"].shape[1]
        inputs = generate_inputs(ft, prompt)
        if warmup and i == 0:
            decode(inputs)
            if compare_greedy:
                target_generate(ft, inputs, max_new_tokens)
        spec_new = _timed_decode(stats, partial(decode, inputs), n_prompt, device)
        greedy_new, seconds = None, 0.0
        if compare_greedy:
            start = synced_clock(device)
            greedy = target_generate_new_tokens(ft, inputs, max_new_tokens)
            seconds = synced_clock(device) - start
            greedy_new = greedy[0].tolist()
            _compared(stats, i, spec_new, greedy_new, seconds)
        if tree_options:  # on the host: the device holds one prompt's tensors at a time, however many prompts
            kept.append((_on_host(prompt), n_prompt, greedy_new, seconds))
    for budget, tree in tree_options:
        run = stats.trees[budget] = DecodeStats(compared=compare_greedy)
        for i, (prompt, n_prompt, greedy_new, seconds) in enumerate(kept):
            inputs = generate_inputs(ft, prompt)
            if warmup and i == 0:
                decode(inputs, tree)
            spec_new = _timed_decode(run, partial(decode, inputs, tree), n_prompt, device)
            if greedy_new is not None:
                _compared(run, i, spec_new, greedy_new, seconds)
    return stats


def _on_host(prompt: dict) -> dict:
    """A prompt's tensors in host memory (those already there are not copied)."""
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in prompt.items()}


def _compared(stats: DecodeStats, i: int, spec_new: list[int], greedy_new: list[int], seconds: float) -> None:
    """Record prompt `i`'s greedy decode (`seconds` long) in `stats`, and a mismatch of its speculative one."""
    stats.greedy_seconds += seconds
    stats.greedy_tokens += len(greedy_new)
    if greedy_new != spec_new:
        stats.mismatches.append(i)


def _timed_decode(stats: DecodeStats, decode, n_prompt: int, device: torch.device) -> list[int]:
    """One timed speculative decode (`decode()`) recorded in `stats`; its new tokens."""
    start = synced_clock(device)
    spec = decode()
    stats.spec_seconds += synced_clock(device) - start
    spec_new = spec.sequences[0, n_prompt:].tolist()
    stats.spec_tokens += len(spec_new)
    stats.acceptance_lengths += spec.acceptance_lengths
    stats.target_forwards += spec.num_target_forwards
    stats.draft_steps[spec.draft_step] = stats.draft_steps.get(spec.draft_step, 0) + 1
    stats.verify_steps[spec.verify_step] = stats.verify_steps.get(spec.verify_step, 0) + 1
    stats.prompts += 1
    return spec_new


__all__ = ["DecodeStats", "decode_benchmark", "synced_clock"]
