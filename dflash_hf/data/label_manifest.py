"""`dflash-generate-labels` as a library: `write_generated_labels` runs the frozen target greedily over a NeMo manifest
and writes a new manifest whose ``text`` is the target's own response (the original kept under the job's
``reference_key``), resumable (`dflash_hf.data.label_rows`). The decoding is handed in (`decode`: the target's greedy
new tokens of encoded prompts, `dflash_hf.generation.target_generate.generated_labels`), so that the rows, their
rendering and the files stay data's. A batch whose decoding runs out of GPU memory stops the run with one
`OutputKeptFault` (`out_of_memory`: the batch, the fix, the rows kept; exit status 75 from the console script); nothing
is retried with a smaller batch."""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from tqdm.auto import tqdm

from dflash_hf.data.bad_samples import BadSamples
from dflash_hf.data.collator import load_audios
from dflash_hf.data.conversation import ConversationConfig, ConversationRenderer, cut_to_messages
from dflash_hf.data.generated import LABEL_IDS_KEY, TRUNCATED_KEY
from dflash_hf.data.json_rows import first_valid_record
from dflash_hf.data.label_rows import (
    LabelCounts,
    check_earlier_rows,
    check_manifest,
    check_output,
    check_resumable,
    check_rows_fit,
    earlier_lines,
    generated_line,
    manifest_rows,
    partial_path,
    record_problem,
    relocate,
    shard_of,
    start_partial,
)
from dflash_hf.data.samples import SamplePipeline
from dflash_hf.data.sources import make_cut, nemo_line_to_cut
from dflash_hf.data.user_text import UserTextCheck
from dflash_hf.errors import OutputKeptFault, oom_reason
from dflash_hf.settings.labels import LabelSettings
from dflash_hf.targets.families.registry import encode_batch
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.targets.processor import check_model_dir, label_target_family

logger = logging.getLogger("dflash_hf.generate_labels")
T = TypeVar("T")
# the target's greedy new tokens of encoded prompt batches (`encode_prompts`), one row per prompt
Decode = Callable[[list[dict]], list[torch.Tensor]]


@dataclass(frozen=True)
class LabelJob:
    """What `write_generated_labels` reads and writes: the input `manifest`, the `output` manifest, prompts per decode
    call (`batch_size`), where a row's original text is kept (`reference_key`), the `conversation` its prompts are
    rendered in, the bad-sample and audio-program policies, whether the next batch is read while the target decodes
    this one (`prefetch`), and the part of the manifest this process labels (`shard_index` of `num_shards`)."""

    manifest: str
    output: str
    batch_size: int
    reference_key: str
    conversation: ConversationConfig
    skip_bad_samples: bool
    allow_command_audio_sources: bool
    prefetch: bool
    num_shards: int
    shard_index: int

    @classmethod
    def of(cls, values: LabelSettings) -> LabelJob:
        """The job of `values` (`dflash-generate-labels`' settings: the fields, and `system_prompt` and `prompt`)."""
        names = [f for f in cls.__dataclass_fields__ if f != "conversation"]
        conversation = ConversationConfig(values.system_prompt, values.prompt)
        return cls(conversation=conversation, **{name: getattr(values, name) for name in names})


def check_label_inputs(settings: LabelSettings) -> tuple:
    """The files `settings` name, before the target loads: the model is an existing directory or a Hub id, the
    manifest a NeMo manifest with a row, the output a new file in an existing directory (`label_rows.check_output`);
    then the shard numbers one of the parts, the rows are what the target reads (audio rows for an audio target,
    from its config alone: `label_rows.check_rows_fit`), and an earlier run's lines are rows of the manifest (and
    shard), each the row its id names (`label_rows.check_resumable`). Returns the target's `(config, family row)`
    that this read (`label_target_family`; `load_label_target` takes it)."""
    check_model_dir(settings.model, "model", "the target")
    if not Path(settings.manifest).is_file():
        raise FileNotFoundError(
            f"field 'manifest': {settings.manifest!r} is not a file; give a NeMo manifest (JSON lines)"
        )
    check_output(settings.manifest, settings.output)
    record = first_valid_record(settings.manifest)  # the first row, read once for both checks
    check_manifest(settings.manifest, record)
    settings.check_shard()
    target = label_target_family(settings.model, settings.family)
    check_rows_fit(settings.manifest, target[1], record)
    check_resumable(
        settings.manifest,
        settings.output,
        settings.reference_key,
        settings.num_shards,
        settings.shard_index,
        settings.skip_bad_samples,
    )
    return target


def one_prompt_at_a_time(family) -> bool:
    """Whether a batch of the family's prompts is decoded one prompt at a time (`encode_prompts`): a model-side
    single-placeholder row (its greedy is not `generate`) and a row whose encoder output depends on the batch's
    padding (`prepare_forward`: Moonshine)."""
    return family.expansion == "model" or family.overrides("prepare_forward")


def encode_prompts(family, processor, config, texts: list[str], audios: list) -> list[dict]:
    """The prompts' `generate` inputs on the CPU: one left-padded batch, except where a batch would change the
    outputs: the rows of `one_prompt_at_a_time` go one at a time."""
    if one_prompt_at_a_time(family):
        return [
            encode_batch(family, processor, config, [t], audios[i : i + 1], padding_side="left")
            for i, t in enumerate(texts)
        ]
    return [encode_batch(family, processor, config, texts, audios, padding_side="left")]


_END = object()  # what `next` returns once the prefetched items are used up


def prefetched(items: Iterator[T]) -> Iterator[T]:
    """`items`, each next one made in a background thread while the caller works on the current one (audio
    decoding and features overlap the target's decoding; the order and any exception are kept)."""
    it = iter(items)
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(next, it, _END)
        while (item := future.result()) is not _END:
            future = pool.submit(next, it, _END)
            yield item


def out_of_memory(
    error: BaseException,
    job: LabelJob,
    target: FrozenTarget,
    encoded: list[dict],
    prompts: int,
    kept: int,
    written: int,
) -> OutputKeptFault:
    """The fault that stops `write_generated_labels` where decoding a batch of `prompts` prompts (`encoded`) ran out
    of GPU memory: the batch, torch's reason, the options that lower the memory (with their values) and where the
    `kept` rows labelled so far (`written` of them by this run) are, which the same command resumes from."""
    one_by_one = one_prompt_at_a_time(target.family)
    widths = [e["input_ids"].shape[-1] for e in encoded if torch.is_tensor(e.get("input_ids"))]
    longest = max(widths) if widths and not one_by_one and not target.is_encoder_decoder else None
    what = f"GPU out of memory generating labels for a batch of {prompts} prompt{'s' * (prompts != 1)}"
    what += (f", the longest {longest} tokens" if longest else "") + f" ({oom_reason(error)})"
    dtype = str(target.dtype).removeprefix("torch.")
    if longest and not target.keeps_last_logits_only:
        vocab = target.lm_head.weight.shape[0]
        size = prompts * longest * vocab * target.lm_head.weight.element_size() / 2**30
        what += (
            ". The target's forward takes no logits_to_keep, so its prefill holds the logits of every prompt position "
            f"({prompts} x {longest} x vocabulary {vocab} in {dtype}: {size:.1f} GiB)"
        )
    fixes = []
    if one_by_one:
        what += f". This target decodes one prompt at a time: --batch_size (now {job.batch_size}) does not change it"
    elif job.batch_size > 1:
        fixes.append(f"lower --batch_size (now {job.batch_size}; e.g. {job.batch_size // 2})")
    if target.dtype == torch.float32:
        fixes.append(
            "load the target with --dtype bfloat16 and give a new --output (labels of one dtype in a manifest)"
        )
    fixes.append("label on a GPU with more memory")
    partial = str(partial_path(Path(job.output)))
    kept_text = (
        f"{partial!r} holds the {kept} row{'s' * (kept != 1)} labelled so far ({written} written by this run)"
        if kept
        else f"No row is labelled yet ({partial!r} is empty)"
    )
    return OutputKeptFault(
        f"{what}. Fix: {', or '.join(fixes)}. {kept_text}; the same command with the same --output resumes from there "
        "(its rows are not labelled again), and --output is written once every row is labelled"
    )


def write_generated_labels(job: LabelJob, target: FrozenTarget, processor, decode: Decode) -> LabelCounts:
    """Write the generated-label manifest of `job` with `target` (its family row and end tokens) and its `processor`;
    `decode` gives the target's new tokens of each batch of encoded prompts. Returns what the new lines hold."""
    family, config = target.family, target.model.config
    bad = BadSamples(skip=job.skip_bad_samples)
    samples = SamplePipeline.build(processor, config, family, job.conversation, bad=bad)  # training's checks
    renderer, validator = samples.renderer, samples.validator
    # decoding and re-rendering here while the prefetch thread encodes with the renderer's tokenizer: a fast tokenizer
    # that sets its padding in one thread can fail ("Already borrowed") while another thread uses it, so use a copy
    check_renderer = ConversationRenderer(copy.deepcopy(processor), family, renderer.config)
    manifest, output = Path(job.manifest), Path(job.output)
    check_output(job.manifest, job.output)
    text_check = UserTextCheck(renderer.tokenizer)
    records = []
    for cut_id, origin, record in manifest_rows(manifest, bad):
        problem = record_problem(record, renderer, text_check)
        if problem:
            bad.report(cut_id, *problem, origin=origin)
            continue
        records.append((cut_id, origin, record))
    if job.num_shards > 1:
        total, records = len(records), shard_of(records, job.num_shards, job.shard_index)
        logger.info("shard %d of %d: %d of the %d lines", job.shard_index, job.num_shards, len(records), total)
    earlier, done = earlier_lines(output, job.reference_key)
    run_rows = [(i, r) for i, _, r in records]  # an earlier run's rows are rows of this run, else refused here
    check_earlier_rows(
        output, done, run_rows, job.manifest, job.reference_key, job.num_shards, job.shard_index, bad.num_skipped
    )
    earlier_rows = sum(len(lines) for lines in done.values())  # the labelled lines copied to the partial file
    todo = [(i, o, r) for i, o, r in records if i not in done]
    logger.info("%d lines in %s, %d already labelled, %d to go", len(records), manifest, len(done), len(todo))

    def batches():  # (size of the chunk, its cuts with their records, their encoded prompts)
        for start in range(0, len(todo), job.batch_size):
            chunk = todo[start : start + job.batch_size]
            cuts = []
            for cut_id, origin, record in chunk:
                if family.has_audio:
                    cut = nemo_line_to_cut(
                        record, cut_id, manifest.parent, bad, origin, allow_programs=job.allow_command_audio_sources
                    )
                else:
                    extras = {k: v for k, v in record.items() if k not in ("text", "lang")}
                    cut = make_cut(cut_id, None, 0.0, 0.0, record.get("text", ""), record.get("lang"), extras)
                cut = validator.check_audio(cut) if cut is not None else None
                if cut is not None:
                    cuts.append((cut, record))
            audios = []
            if family.has_audio:  # a row whose audio is bad when read: raised, or skipped and counted
                kept, audios, skipped = load_audios([c for c, _ in cuts], family.sampling_rate, bad)
                bad.add_skipped(skipped)
                kept_ids = {id(c) for c in kept}
                cuts = [(c, r) for c, r in cuts if id(c) in kept_ids]
            texts = [
                renderer.render_text(cut_to_messages(c, family, renderer.config)[:-1], add_generation_prompt=True)
                for c, _ in cuts
            ]
            yield len(chunk), cuts, encode_prompts(family, processor, config, texts, audios) if cuts else []

    ends = target.special_ids().get("eos_token_id", set())
    counts = LabelCounts()
    if not todo and not partial_path(output).exists():
        logger.info("%s is complete: nothing to label", output)
        return counts
    partial = start_partial(output, earlier)
    with open(partial, "a", encoding="utf-8") as out, tqdm(total=len(todo), desc="generate-labels", unit="utt") as bar:
        for size, cuts, encoded in prefetched(batches()) if job.prefetch else batches():
            if cuts:
                try:
                    labels = decode(encoded)
                except torch.OutOfMemoryError as err:  # the batches before this one are in the partial file
                    kept = earlier_rows + counts.written
                    raise out_of_memory(err, job, target, encoded, len(cuts), kept, counts.written) from err
                for (cut, record), ids in zip(cuts, labels):
                    line = {k: v for k, v in record.items() if k not in (LABEL_IDS_KEY, TRUNCATED_KEY)}
                    line[job.reference_key] = record.get("text")
                    line.update(generated_line(cut, ids.tolist(), ends, check_renderer, counts, validator.audio_id))
                    line["id"] = cut.id
                    if "audio_filepath" in record:
                        line["audio_filepath"] = relocate(record["audio_filepath"], manifest.parent, output.parent)
                    out.write(json.dumps(line, ensure_ascii=False) + "\n")
                    counts.written += 1
                out.flush()
            bar.update(size)
        os.fsync(out.fileno())
    os.replace(partial, output)  # complete: the output appears (or is replaced) in one step
    if bad.num_skipped:
        logger.warning(bad.summary())
    return counts


__all__ = [
    "Decode",
    "LabelJob",
    "check_label_inputs",
    "encode_prompts",
    "one_prompt_at_a_time",
    "out_of_memory",
    "prefetched",
    "write_generated_labels",
]
