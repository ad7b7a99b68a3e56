"""The two passes of `decode_profile.py`: the un-instrumented `decode_benchmark` and the instrumented decode of the
same prompts, with their outputs compared."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dflash_hf.export.evaluation_setup import evaluation_device
from dflash_hf.generation import evaluation, speculative
from dflash_hf.generation.decode_options import DecodeOptions
from dflash_hf.targets.families.registry import generate_kwargs
from dflash_hf.targets.frozen import FrozenTarget, resolve_dtype

from .arguments import ProfileArguments
from .inputs import real_setup, tiny_setup
from .instrument import PhaseClock, breakdown, instrumented
from .record import device_name, git_commit
from .report import run_name


@contextmanager
def recorded_sequences(store: list):
    """Record the sequences of every `speculative_generate` call `decode_benchmark` makes."""
    real = evaluation.speculative_generate

    def recorder(*args, **kwargs):
        out = real(*args, **kwargs)
        store.append(out.sequences)
        return out

    evaluation.speculative_generate = recorder
    try:
        yield
    finally:
        evaluation.speculative_generate = real


def profile_pass(
    draft,
    ft: FrozenTarget,
    prompts: list[dict],
    max_new_tokens: int,
    progress: bool,
    options: DecodeOptions | None = None,
):
    """Instrumented speculative decoding of every prompt (`options`: how its steps run): (breakdown, sequences)."""
    clock = PhaseClock(ft.device)
    sequences, cycles, tokens = [], 0, 0
    with instrumented(draft, clock):
        for inputs in tqdm(prompts, disable=not progress, desc="instrumented"):
            n_prompt = inputs["input_ids"].shape[1]
            kwargs = generate_kwargs(
                ft.family, {k: v.to(ft.device) if torch.is_tensor(v) else v for k, v in inputs.items()}
            )
            with clock.measure("total"):
                out = speculative.speculative_generate(
                    draft,
                    ft,
                    max_new_tokens,
                    options=options,
                    **kwargs,
                )
            sequences.append(out.sequences)
            cycles += len(out.acceptance_lengths)
            tokens += out.sequences.shape[1] - n_prompt
    return breakdown(clock.seconds, cycles, tokens), sequences


def run_profile(args: ProfileArguments, command: str) -> dict:
    commit = git_commit()  # before the run: the code that was imported
    device = evaluation_device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            ft, draft, prompts = tiny_setup(args.tiny, args.num_prompts, Path(tmp))
            dtype = resolve_dtype(args.precision)
            ft.model.to(device=device, dtype=dtype)
            draft.to(device=device, dtype=dtype)
        else:
            ft, draft, prompts = real_setup(args, device)
    options = DecodeOptions.from_settings(args)
    prompts = [ft.cast_features(p) for p in prompts]  # audio features in the target's dtype (bf16 encoders refuse fp32)
    reference: list = []
    with recorded_sequences(reference), torch.no_grad():
        stats = evaluation.decode_benchmark(
            draft,
            ft,
            prompts,
            args.max_new_tokens,
            progress=args.progress,
            total=len(prompts),
            options=options,
        )
    reference = reference[-len(prompts) :]  # the warm-up decode of the first prompt comes first
    with torch.no_grad():
        profile, sequences = profile_pass(draft, ft, prompts, args.max_new_tokens, args.progress, options)
    same = [torch.equal(a.cpu(), b.cpu()) for a, b in zip(sequences, reference)]
    wall = stats.as_dict()
    return {
        "name": run_name(args),
        "commit": commit,
        "command": command,
        "device": device_name(device),
        "torch": torch.__version__,
        "precision": args.precision,
        "block_size": draft.config.block_size,
        "draft_class": type(draft).__name__,
        "family": ft.family.name,
        "wall_clock": wall,
        "instrumented": profile,
        "instrumented_outputs_identical": all(same),
        "outputs_identical": all(same) and wall["outputs_identical"],
        "args": asdict(args),
    }
