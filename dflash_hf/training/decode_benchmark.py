"""Decoding evaluation (docs/EVALUATION.md); validate-only (`DFlashTrainer.evaluate` without training) is
`dflash_hf.training.validate_only`, above the trainer, so that the trainer's callbacks can use this module without a
circle.

- :func:`prompt_inputs`: the prompt of a one-row batch (every real token before the first supervised one),
  i.e. what a user sends at inference.
- :func:`decode_benchmark`: speculative decoding against the target's own greedy `generate` on the same
  prompts: real tau, tokens/s of both, and whether the outputs are identical.

The conversation a draft was trained with is its export's training record (`dflash_hf.export.training_record`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from dflash_hf.generation.speculative import model_side_greedy, speculative_generate
from dflash_hf.generation.tree_decode import check_tree_budget
from dflash_hf.generation.tree_verify import check_tree_target
from dflash_hf.generation.verify_rules import max_new_tokens_given
from dflash_hf.settings import DataSettings
from dflash_hf.targets.families.registry import generate_kwargs
from dflash_hf.targets.frozen import NON_TARGET_KEYS, FrozenTarget, TargetModel


# ------------------------------------------------------------------------------------------------
# Prompts and decoding
# ------------------------------------------------------------------------------------------------
def prompt_inputs(batch: Mapping[str, torch.Tensor]) -> dict | None:
    """Target inputs of the prompt of a one-row batch: the real tokens before the first supervised token,
    with the family's audio kwargs unchanged. None when the row has no supervised token."""
    ids = batch["input_ids"]
    if ids.shape[0] != 1:
        raise ValueError(f"prompt_inputs takes a one-row batch, got {ids.shape[0]} rows")
    real = batch["attention_mask"][0].bool()
    supervised = (batch["loss_mask"][0].bool() & real).nonzero().flatten()
    if supervised.numel() == 0:
        return None
    keep = real.clone()
    keep[int(supervised[0]) :] = False
    out = {k: v for k, v in batch.items() if k not in NON_TARGET_KEYS and k not in ("input_ids", "attention_mask")}
    out.pop("position_ids", None)  # one document: default positions
    out["input_ids"] = ids[:, keep]
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    return out


def iter_prompts(rows: Iterable, collate: Callable[[list], dict]) -> Iterator[dict]:
    """Prompts (see `prompt_inputs`) of the rows that have a supervised token, each row collated on its own."""
    for row in rows:
        p = prompt_inputs(collate([row]))
        if p is not None:
            yield p


def prompts_from(rows: Iterable, collate: Callable[[list], dict], limit: int) -> list[dict]:
    """The first `limit` prompts of `iter_prompts`."""
    return list(itertools.islice(iter_prompts(rows, collate), limit))


def dataset_rows(dataset) -> Iterable:
    """Rows in order: by index for a sized map-style dataset, else by iteration (IterableDataset, CutSet)."""
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        return iter(dataset)
    return (dataset[i] for i in range(len(dataset)))


def prompt_source(path: str | Path, max_chars_per_second: float | None = None, **policy):
    """The `DataSource` of a file whose rows are decoded as prompts (`dflash-eval`, benchmarks). Their response text
    is neither trained on nor decoded against, so training's characters-per-second check is off by default
    (`max_chars_per_second` None): a long reference answer is no bad row here. `policy`: the other `DataSource`
    fields (`allow_command_audio_sources`, ...)."""
    from dflash_hf.data import DataSource

    return DataSource(path=str(path), max_chars_per_second=max_chars_per_second, **policy)


def speech_rows_and_collator(
    source,
    processor,
    target_config,
    *,
    family=None,
    conversation=None,
    padding_side: str = "left",
    skip_bad_samples: bool = DataSettings.skip_bad_samples,
    resample_audio: bool = DataSettings.resample_audio,
    max_chars_per_second: float | None = None,
):
    """Validated cuts of a speech source (NeMo manifest / lhotse cuts path, `DataSource`, or a list of them) and
    the padded collator that renders one cut as the target's processor would (dflash_hf.data). The cuts pass the
    same `SampleValidator` as training's (bad rows raise, or are skipped with `skip_bad_samples`); a `DataSource` is
    opened with its own checks, a path as a `prompt_source` with `max_chars_per_second` (None: no characters-per-second
    check; a trainer's validation set passes the rate its loss loader applies, so both read the same rows).
    `family`: a `TargetFamily` (e.g. a `FrozenTarget`'s), a family row name, or None (resolved from the config)."""
    from dflash_hf.data import BadSamples, open_source
    from dflash_hf.data.sample_checks import ValidatedCuts
    from dflash_hf.data.samples import SamplePipeline

    bad = BadSamples(skip=skip_bad_samples)
    samples = SamplePipeline.build(
        processor, target_config, family, conversation, bad=bad, resample_audio=resample_audio
    )
    sources = source if isinstance(source, (list, tuple)) else [source]
    sources = [prompt_source(s, max_chars_per_second) if isinstance(s, (str, Path)) else s for s in sources]
    rows = ValidatedCuts(itertools.chain.from_iterable(open_source(s, bad) for s in sources), samples.validator)
    return rows, samples.collator(padding_side)


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


def generate_inputs(ft: FrozenTarget, inputs: dict) -> dict:
    """A prompt's processor outputs on the target's device, float features in its dtype, as `generate` takes them."""
    on_device = {k: v.to(ft.device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    return generate_kwargs(ft.family, ft.cast_features(on_device))


def target_greedy(ft: FrozenTarget, inputs: dict, max_new_tokens: int, **generate_options) -> torch.Tensor:
    """The target's own greedy decoding: prompt + new tokens, as `generate(return_dict_in_generate=True)` gives them
    (rows padded with the end token). A model-side single-placeholder target decodes without `generate`, which cannot
    run its audio merge. Whisper with its decoder prompt given takes its plain `generate` (`_whisper_greedy`).
    `generate_options` go to `generate` (e.g. `cache_implementation="static"`: a static cache, compiled on a GPU)."""
    if ft.family.expansion == "model":
        if generate_options:
            raise ValueError(
                f"generate options {sorted(generate_options)}: a model-side single-placeholder target "
                "decodes without generate"
            )
        return model_side_greedy(ft, max_new_tokens, **inputs)
    with max_new_tokens_given():
        if ft.family.name == "whisper" and "decoder_input_ids" in inputs:
            new = _whisper_greedy(ft, inputs, max_new_tokens, generate_options)
            if new is not None:
                return new
        out = ft.model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True, **generate_options
        )
    return out.sequences


def _whisper_greedy(ft: FrozenTarget, inputs: dict, max_new_tokens: int, options: dict) -> torch.Tensor | None:
    """Whisper's plain `generate` returns only the new tokens, its final end token dropped and rows padded with the
    pad token; with `return_dict_in_generate` it would copy every row's self- and cross-attention cache to the CPU and
    back (37 MB a row for Whisper-base), a cost neither a user's `generate` nor speculative decoding pays. The prompt
    and the end token are put back (unless the longest row ran to `max_new_tokens`: then no row of that length ended).
    None (take the dict call) where the two could differ: a pad token other than the one end token (the plain call
    strips every pad id of a row), or a timestamp token in the output (Whisper then splits segments and may decode
    past the window, where the dict call returns the last call's sequences)."""
    gc = ft.model.generation_config
    if not isinstance(gc.eos_token_id, int) or gc.pad_token_id != gc.eos_token_id:
        return None
    prompt = inputs["decoder_input_ids"]
    new = ft.model.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=False, **options
    )  # [b, n]
    timestamps = getattr(gc, "no_timestamps_token_id", None)
    if new.shape[1] > max_new_tokens or (timestamps is not None and bool((new > timestamps).any())):
        return None
    if new.shape[1] < max_new_tokens:
        new = torch.cat([new, new.new_full((new.shape[0], 1), gc.eos_token_id)], dim=1)
    return torch.cat([prompt.to(new.device), new], dim=1)


def target_greedy_new_tokens(ft: FrozenTarget, inputs: dict, max_new_tokens: int, **generate_options) -> torch.Tensor:
    """The new tokens of `target_greedy` (`[b, new]`, padded with the end token), where only they are needed
    (generated labels)."""
    prompt = inputs["decoder_input_ids"] if ft.is_encoder_decoder else inputs["input_ids"]
    return target_greedy(ft, inputs, max_new_tokens, **generate_options)[:, prompt.shape[1] :]


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
    draft_cuda_graph: bool | None = None,
    verify_cuda_graph: bool | None = None,
    tree_budgets: Sequence[int] = (),
) -> DecodeStats:
    """Greedy speculative decoding of every prompt (target inputs of one prompt each). With
    `compare_greedy`, the target's own `generate(do_sample=False)` decodes the same prompt and the two
    outputs must be token-identical (a mismatch is recorded, not raised). `warmup` decodes the first prompt
    once untimed (kernel and allocator start-up, and the CUDA graph captures). `draft_cuda_graph`,
    `verify_cuda_graph`: as for `speculative_generate`. `tree_budgets`: after the chain's pass, one pass over the same
    prompts per budget with tree verification (`speculative_generate(tree_budget=...)`; its own untimed warm-up: each
    budget captures its own fixed-shape steps), compared with the chain pass's greedy decodes; their figures are the
    returned stats' `trees`. A budget or a target that tree verification cannot take is refused before any
    decoding."""
    ft = target if isinstance(target, FrozenTarget) else FrozenTarget(target)
    for budget in tree_budgets:
        check_tree_budget(budget)
    if tree_budgets:
        check_tree_target(ft)
    device = ft.device
    stats = DecodeStats(compared=compare_greedy)
    kept: list[tuple[dict, int, list[int] | None, float]] = []  # the tree passes' prompts (host) and greedy decodes

    def decode(inputs, budget=None):
        return speculative_generate(
            draft,
            ft,
            max_new_tokens,
            draft_cuda_graph=draft_cuda_graph,
            verify_cuda_graph=verify_cuda_graph,
            tree_budget=budget,
            **inputs,
        )

    for i, prompt in enumerate(tqdm(prompts, total=total, disable=not progress, desc="dflash-eval")):
        n_prompt = prompt["input_ids"].shape[1]
        inputs = generate_inputs(ft, prompt)
        if warmup and i == 0:
            decode(inputs)
            if compare_greedy:
                target_greedy(ft, inputs, max_new_tokens)
        spec_new = _timed_decode(stats, partial(decode, inputs), n_prompt, device)
        greedy_new, seconds = None, 0.0
        if compare_greedy:
            start = synced_clock(device)
            greedy = target_greedy_new_tokens(ft, inputs, max_new_tokens)
            seconds = synced_clock(device) - start
            greedy_new = greedy[0].tolist()
            _compared(stats, i, spec_new, greedy_new, seconds)
        if tree_budgets:  # on the host: the device holds one prompt's tensors at a time, however many prompts
            kept.append((_on_host(prompt), n_prompt, greedy_new, seconds))
    for budget in tree_budgets:
        run = stats.trees[budget] = DecodeStats(compared=compare_greedy)
        for i, (prompt, n_prompt, greedy_new, seconds) in enumerate(kept):
            inputs = generate_inputs(ft, prompt)
            if warmup and i == 0:
                decode(inputs, budget)
            spec_new = _timed_decode(run, partial(decode, inputs, budget), n_prompt, device)
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


__all__ = [
    "DecodeStats",
    "decode_benchmark",
    "generate_inputs",
    "synced_clock",
    "target_greedy",
    "target_greedy_new_tokens",
    "prompt_inputs",
    "dataset_rows",
    "iter_prompts",
    "prompts_from",
    "prompt_source",
    "speech_rows_and_collator",
]
