"""What `dflash-eval` (and the decoding benchmarks) decode: a draft export on its frozen target, with the conversation
its training record names, and the prompts of a data file (`load_evaluation`). `dflash_hf.generation.evaluation`
decodes them.

- :func:`check_evaluation_inputs`: the files the settings name, before anything loads.
- :func:`apply_recorded_conversation`: `--prompt`, `--system_prompt` and `--family` left out take the values the
  draft was trained with (recorded in its export); given ones that differ are warned about.
- :func:`load_evaluation`: the device, the target, the draft checked against it, and the prompts.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

import torch

from dflash_hf.data.eval_rows import evaluation_prompts, recorded_conversation
from dflash_hf.data.text_prompts import count_records, is_text_prompts
from dflash_hf.export.draft_target import draft_on_target
from dflash_hf.export.drafts import load_draft_strict, resolve_draft_dir
from dflash_hf.export.training_record import TRAINING_RECORD_FILE, read_training_record
from dflash_hf.settings.checks import check_paths_exist
from dflash_hf.settings.evaluation import EvalSettings
from dflash_hf.targets.frozen import FrozenTarget, load_target, resolve_dtype
from dflash_hf.targets.processor import check_model_dir, load_processor

logger = logging.getLogger("dflash_hf")


def check_evaluation_inputs(settings: EvalSettings) -> None:
    """The draft and data exist and the target is an existing directory or a Hub id (before anything loads)."""
    check_paths_exist(settings, ("draft", "data"))
    check_model_dir(settings.target, "--target", "the frozen target")


def no_text(value: str | None) -> str | None:
    """An empty prompt is no prompt (the conversation leaves out an empty user text or system turn)."""
    return value or None


def apply_recorded_conversation(settings: EvalSettings, recorded: dict | None) -> dict | None:
    """Fill `--prompt`, `--system_prompt` and `--family` left out (None) from the conversation recorded in the draft's
    export (`recorded`: its training record's), and warn about each given one that differs from it, about a draft that
    records none (a manifest's prompts are then rendered from the flags alone) and about text prompts (rendered as they
    are, without the recorded settings). Returns the recorded conversation (None when there is none)."""
    text = is_text_prompts(settings.data)
    where = f"{settings.draft}/{TRAINING_RECORD_FILE}"
    if recorded is None:
        if not text:
            logger.warning(
                "the draft export %s records no conversation settings (exported before they were recorded, or "
                "trained on rows collated outside dflash-train): its prompts are rendered with --prompt %r and "
                "--system_prompt %r as given; they must be the training run's for tau to measure what the draft "
                "learned",
                settings.draft,
                settings.prompt,
                settings.system_prompt,
            )
        return None
    if text:
        if no_text(recorded["prompt"]) or no_text(recorded["system_prompt"]):
            logger.warning(
                "--data %s holds text prompts, rendered as they are: the conversation the draft was trained with "
                "(prompt %r, system prompt %r, recorded in %s) is not applied to them",
                settings.data,
                recorded["prompt"],
                recorded["system_prompt"],
                where,
            )
    for name, what in (("prompt", "user prompt"), ("system_prompt", "system prompt"), ("family", "family row")):
        given, trained = getattr(settings, name), recorded[name]
        if given is None:
            setattr(settings, name, trained)
        elif (given if name == "family" else no_text(given)) != (trained if name == "family" else no_text(trained)):
            logger.warning(
                "--%s %r differs from the %s the draft was trained with (%r, recorded in %s): tau then measures "
                "prompts the draft was not trained on; leave --%s out to decode with the recorded one",
                name,
                given,
                what,
                trained,
                where,
                name,
            )
    return recorded


def evaluation_device(device: str) -> torch.device:
    """`--device`: cpu, cuda, cuda:N, or auto (cuda when available)."""
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)


def load_evaluation(
    settings: EvalSettings,
) -> tuple[torch.device, FrozenTarget, torch.nn.Module, Iterator[dict], int]:
    """The device, the frozen target, the draft (checked against the target), the prompts (lazily, at most
    `num_samples`) and their count at most (a row without an assistant response gives no prompt). The settings'
    conversation fields left out take the draft's recorded ones (`apply_recorded_conversation`)."""
    check_evaluation_inputs(settings)
    device = evaluation_device(settings.device)
    draft = load_draft_strict(settings.draft)
    recorded = read_training_record(resolve_draft_dir(settings.draft)).conversation
    recorded = apply_recorded_conversation(settings, recorded)  # before the family is resolved
    target = FrozenTarget(load_target(settings.target, settings.precision).to(device), settings.family)
    draft = draft_on_target(draft, target, resolve_dtype(settings.precision))
    prompts = evaluation_prompts(
        settings.data,
        load_processor(settings.target),
        target.model.config,
        family=settings.family,
        conversation=recorded_conversation(recorded, prompt=settings.prompt, system_prompt=settings.system_prompt),
        allow_command_audio_sources=settings.allow_command_audio_sources,
    )
    total = count_records(settings.data)
    if settings.num_samples:
        prompts = itertools.islice(prompts, settings.num_samples)
        total = min(total, settings.num_samples)
    return device, target, draft, prompts, total


__all__ = [
    "apply_recorded_conversation",
    "check_evaluation_inputs",
    "evaluation_device",
    "load_evaluation",
    "no_text",
]
