"""Evaluation rows: the prompts speculative decoding is measured on (`dflash-eval`, the real tau of validation sets,
the benchmarks), made from the same rows and rendering as training's.

- :func:`prompt_inputs`: the prompt of a one-row batch (every real token before the first supervised one), i.e. what
  a user sends at inference.
- :func:`speech_rows_and_collator`: validated cuts of a speech source and the collator that renders one of them.
- :func:`evaluation_prompts`: the prompts of a file, a manifest or JSON lines of text prompts (`dflash-eval --data`).
- :func:`prompts_and_references`: the prompts of a manifest with the text of their responses (a target's WER).

`dflash_hf.generation.evaluation.decode_benchmark` decodes what these give (plain dicts of tensors).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch

from dflash_hf.data.bad_samples import BadSamples
from dflash_hf.data.conversation import ConversationConfig
from dflash_hf.data.loader import build_train_dataloader
from dflash_hf.data.sample_checks import ValidatedCuts
from dflash_hf.data.samples import SamplePipeline
from dflash_hf.data.sources import DataSource, open_source
from dflash_hf.data.text_prompts import is_text_prompts, text_prompts
from dflash_hf.settings import DataSettings
from dflash_hf.targets.families.base import get_tokenizer
from dflash_hf.targets.families.registry import resolve_family
from dflash_hf.targets.frozen import NON_TARGET_KEYS


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
    bad = BadSamples(skip=skip_bad_samples)
    samples = SamplePipeline.build(
        processor, target_config, family, conversation, bad=bad, resample_audio=resample_audio
    )
    sources = source if isinstance(source, (list, tuple)) else [source]
    sources = [prompt_source(s, max_chars_per_second) if isinstance(s, (str, Path)) else s for s in sources]
    rows = ValidatedCuts(itertools.chain.from_iterable(open_source(s, bad) for s in sources), samples.validator)
    return rows, samples.collator(padding_side)


def recorded_conversation(
    recorded: Mapping | None, *, prompt: str | None = None, system_prompt: str | None = None
) -> ConversationConfig:
    """The conversation of evaluation prompts: `prompt` and `system_prompt`, and the cut fields (`context_key`,
    `system_prompt_key`) of the conversation a draft was trained with (`recorded`: its export's training record's
    `conversation`; None: the defaults)."""
    keys = {k: recorded[k] for k in ("context_key", "system_prompt_key")} if recorded else {}
    return ConversationConfig(system_prompt=system_prompt, prompt=prompt, **keys)


def evaluation_prompts(
    path: str,
    processor,
    config,
    *,
    family: str | None = None,
    conversation: ConversationConfig | None = None,
    allow_command_audio_sources: bool = DataSettings.allow_command_audio_sources,
) -> Iterator[dict]:
    """The target inputs of the prompts of `path` (`dflash-eval --data`), lazily: JSON lines of text prompts
    (`dflash_hf.data.text_prompts`; a text target only), or a NeMo manifest / lhotse cuts file whose rows, rendered
    in `conversation`, are cut before their response (`prompt_source`: no characters-per-second check). `family`: the
    family row name (None: from `config`)."""
    if is_text_prompts(path):
        fam = resolve_family(config, family)
        if fam.has_audio:
            raise ValueError(
                f"--data {path!r} holds text prompts but the target is a speech model ({fam.name}); "
                "give a NeMo manifest with audio_filepath lines"
            )
        return text_prompts(path, get_tokenizer(processor))
    source = prompt_source(path, allow_command_audio_sources=allow_command_audio_sources)  # no rate check
    rows, collate = speech_rows_and_collator(source, processor, config, family=family, conversation=conversation)
    return iter_prompts(rows, collate)


def prompts_and_references(
    manifest: str | Path, processor, target_config, *, max_tokens: int, conversation: ConversationConfig
) -> list[tuple[dict, str]]:
    """(prompt inputs, reference transcript) of each row of `manifest` that has a response, in order: the audio and
    instruction without the response (`prompt_inputs`), and the response's text. The rows are read as training reads
    them (`build_train_dataloader`, one row a batch, `max_tokens` its token budget), unshuffled."""
    tokenizer = get_tokenizer(processor)
    loader = build_train_dataloader(
        str(manifest),
        processor,
        target_config,
        max_tokens=max_tokens,
        max_batch_size=1,
        conversation=conversation,
        shuffle=False,
    )
    rows = []
    for batch in loader:
        prompt = prompt_inputs(batch)
        if prompt is not None:
            response = batch["input_ids"][0][batch["loss_mask"][0].bool()]
            rows.append((prompt, tokenizer.decode(response, skip_special_tokens=True)))
    return rows


__all__ = [
    "dataset_rows",
    "evaluation_prompts",
    "iter_prompts",
    "prompt_inputs",
    "prompt_source",
    "prompts_and_references",
    "prompts_from",
    "recorded_conversation",
    "speech_rows_and_collator",
]
