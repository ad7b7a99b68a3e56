"""``dflash-generate-labels``: run the frozen target greedily over a NeMo manifest and write a new manifest
whose ``text`` is the target's own response (the original kept under ``reference_key``).

Same audio path / offset / duration / context and every other key; each output line also carries the cut
``id`` so the run is resumable: rows already in the output are not labelled again. A row whose text does not
re-encode to the tokens the target wrote keeps them as ``label_ids``, and an output cut by ``--max_new_tokens``
before the target's end is marked ``truncated`` (``dflash_hf.data.generated``; training takes both into account).
The output is never written in place: the lines go to ``<output>.partial`` (kept by an interrupted run, and resumed
from), renamed over ``--output`` once complete; an output that is the input manifest is refused. See
docs/GENERATED_LABELS.md.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
import transformers
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoProcessor, AutoTokenizer, HfArgumentParser

from dflash_hf.cli.config import check_model_dir, parse_with_config
from dflash_hf.data.bad_samples import BadSamples
from dflash_hf.data.collator import load_audios
from dflash_hf.data.conversation import ConversationConfig, ConversationRenderer, cut_to_messages
from dflash_hf.data.generated import LABEL_IDS_KEY, TRUNCATED_KEY, decoded_response, generated_problem
from dflash_hf.data.json_rows import detect_kind, json_rows, manifest_stem
from dflash_hf.data.samples import SamplePipeline
from dflash_hf.data.sources import _make_cut, nemo_line_to_cut
from dflash_hf.data.user_text import UserTextCheck
from dflash_hf.settings import DataSettings
from dflash_hf.targets.families.registry import encode_batch, generate_kwargs, resolve_family
from dflash_hf.targets.families.whisper_features import with_fast_features
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.training.decode_benchmark import target_greedy_new_tokens

logger = logging.getLogger("dflash_hf.generate_labels")
T = TypeVar("T")


@dataclass
class GenerateLabelsArguments:
    model: str = field(metadata={"help": "target model directory (or hub id already in the local cache)"})
    manifest: str = field(metadata={"help": "input NeMo manifest (JSON lines)"})
    output: str = field(metadata={"help": "output manifest; appended to and resumed if it exists"})
    family: str | None = field(default=None, metadata={"help": "target family override (see docs/DATA.md)"})
    batch_size: int = field(default=8, metadata={"help": "utterances per generate() call"})
    max_new_tokens: int = field(default=256)
    system_prompt: str | None = field(default=None)
    prompt: str | None = field(default=None, metadata={"help": "default user text (a line's context wins)"})
    reference_key: str = field(default="reference_text", metadata={"help": "where the original text is kept"})
    skip_bad_samples: bool = field(default=DataSettings.skip_bad_samples)
    allow_command_audio_sources: bool = field(
        default=DataSettings.allow_command_audio_sources,
        metadata={
            "help": "let decoder programs (ffmpeg through audioread) read audio files libsndfile cannot; only for "
            "data you trust (default: such a file is a bad sample)"
        },
    )
    device: str = field(default="cpu")
    prefetch: bool = field(
        default=True,
        metadata={
            "help": "read the next batch's audio and make its features in a "
            "background thread while the target decodes this one"
        },
    )
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})
    num_shards: int = field(
        default=1,
        metadata={
            "help": "split the manifest's lines into this many contiguous parts, one per process (e.g. one per GPU)"
        },
    )
    shard_index: int = field(
        default=0,
        metadata={
            "help": "the part this process labels (0-based); concatenating the "
            "outputs in shard order keeps the manifest's order"
        },
    )

    def __post_init__(self):
        for name in ("batch_size", "max_new_tokens", "num_shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"field '{name}' must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"field 'dtype' must be float32, bfloat16 or float16, got {self.dtype!r}")
        check_model_dir(self.model, "model", "the target")
        if not Path(self.manifest).is_file():
            raise FileNotFoundError(
                f"field 'manifest': {self.manifest!r} is not a file; give a NeMo manifest (JSON lines)"
            )
        check_output(self.manifest, self.output)
        check_manifest(self.manifest)
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(
                f"field 'shard_index' must be in [0, num_shards={self.num_shards}), got "
                f"{self.shard_index}: number the parts 0 .. num_shards - 1"
            )


def shard_of(records: list, num_shards: int, shard_index: int) -> list:
    """Part `shard_index` of `num_shards` contiguous, near-equal parts of `records` (the last ones may be empty)."""
    size = -(-len(records) // num_shards)
    return records[shard_index * size : (shard_index + 1) * size]


def make_parser() -> HfArgumentParser:
    return HfArgumentParser(GenerateLabelsArguments)


def _load_target(args: GenerateLabelsArguments):
    config = AutoConfig.from_pretrained(args.model)
    family = resolve_family(config, args.family)
    dtype = getattr(torch, args.dtype)
    if family.has_audio:
        processor = with_fast_features(AutoProcessor.from_pretrained(args.model))  # exact, faster Whisper log-mel
        arch = (config.architectures or [None])[0]
        if arch is None or not hasattr(transformers, arch):
            raise ValueError(f"{args.model}: config.architectures={config.architectures} names no transformers class")
        model = getattr(transformers, arch).from_pretrained(args.model, dtype=dtype)
    else:
        processor = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    return model.to(args.device).eval(), processor, family


def check_output(manifest: str, output: str) -> None:
    """``--output`` must not be the manifest (same path, or the same file under another name), nor a directory, and
    its directory must exist."""
    out, src = Path(output), Path(manifest)
    if out.resolve() == src.resolve() or (out.exists() and src.exists() and os.path.samefile(out, src)):
        raise ValueError(
            f"field 'output': {output!r} is the input manifest {manifest!r}; the generated labels go to a new file: "
            "give another --output"
        )
    if out.is_dir():
        raise IsADirectoryError(f"field 'output': {output!r} is a directory; give a file path for the new manifest")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"field 'output': the directory of {output!r} does not exist; create it first")


def check_manifest(manifest: str) -> None:
    """``--manifest`` is a NeMo manifest with at least one row (read up to its first JSON object line)."""
    try:
        kind = detect_kind(manifest)
    except ValueError as e:
        raise ValueError(f"field 'manifest': {e}") from None
    if kind != "nemo":
        raise ValueError(
            f"field 'manifest': {manifest!r} is a lhotse cuts file; dflash-generate-labels reads NeMo manifests "
            "(JSON lines with audio_filepath, duration, text): write the cuts as one"
        )


def partial_path(output: Path) -> Path:
    """Where the lines are written until the output is complete (an interrupted run leaves it; the next resumes)."""
    return output.with_name(output.name + ".partial")


def _earlier_lines(output: Path) -> list[str]:
    """The complete lines an earlier run wrote: of ``<output>.partial`` when an interrupted run left one, else of the
    output. A last line without its newline (an interrupted write) is left out, its row labelled again; a line that
    is not a labelled row (no ``id``) is an error: the file is not this tool's output."""
    source = partial_path(output) if partial_path(output).exists() else output
    if not source.exists():
        return []
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        logger.warning("%s: the last line is incomplete (an interrupted write); its row is labelled again", source)
        lines.pop()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            record = e
        if not isinstance(record, dict) or not isinstance(record.get("id"), str):
            raise ValueError(
                f"field 'output': {str(source)!r} line {number} is not a row dflash-generate-labels wrote (a JSON "
                "object with a string 'id'); give a new --output (the file is left as it is)"
            )
    return lines


def _done_ids(lines: list[str]) -> set[str]:
    return {json.loads(line)["id"] for line in lines if line.strip()}


def _start_partial(output: Path, lines: list[str]) -> Path:
    """``<output>.partial`` holding `lines` (written beside it and renamed in, so a kill never loses them)."""
    partial = partial_path(output)
    staged = partial.with_name(partial.name + ".tmp")
    with open(staged, "w", encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staged, partial)
    return partial


def _record_problem(record: dict, renderer: ConversationRenderer, check: UserTextCheck) -> tuple[str, str, str] | None:
    """``(field, problem, fix)`` of a row the prompt or the output file cannot take: a control token or a lone
    surrogate in the text fields that go into the prompt, a lone surrogate anywhere (not writable as UTF-8)."""
    for key in (renderer.config.context_key, renderer.config.system_prompt_key):
        if isinstance(record.get(key), str):
            problem = check.problem(key, record[key])
            if problem:
                return problem
    for key, value in record.items():
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            return (
                key,
                f"holds a lone UTF-16 surrogate ({e.reason}), which is not text",
                "write the value as valid UTF-8 text",
            )
    return None


def _relocate(audio_filepath: str, manifest_dir: Path, output_dir: Path) -> str:
    """A relative audio path, re-expressed relative to the output manifest (absolute paths unchanged)."""
    path = Path(audio_filepath)
    if path.is_absolute():
        return audio_filepath
    return os.path.relpath(manifest_dir.resolve() / path, output_dir.resolve())


def _encode(family, processor, config, texts: list[str], audios: list) -> list[dict]:
    """The prompts' `generate` inputs on the CPU: one left-padded batch, except where a batch would change the
    outputs: a model-side single-placeholder row (its greedy is not `generate`) and a row whose encoder output depends
    on the batch's padding (`prepare_forward`: Moonshine) go one at a time."""
    if family.expansion == "model" or family.overrides("prepare_forward"):
        return [
            encode_batch(family, processor, config, [t], audios[i : i + 1], padding_side="left")
            for i, t in enumerate(texts)
        ]
    return [encode_batch(family, processor, config, texts, audios, padding_side="left")]


def _greedy_new_tokens(target: FrozenTarget, encoded: list[dict], args) -> list[torch.Tensor]:
    """The target's greedy new tokens (`evaluation.target_greedy_new_tokens`), one per prompt, for `_encode`'s
    inputs; audio (features or waveform) goes to the target's dtype, ids and masks as they are."""
    rows = []
    for inputs in encoded:
        inputs = {
            k: v.to(args.device, target.model.dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()
        }
        rows.extend(target_greedy_new_tokens(target, generate_kwargs(target.family, inputs), args.max_new_tokens))
    return rows


@dataclass
class LabelCounts:
    """What a run wrote: rows, rows cut by `max_new_tokens` (marked `truncated`), rows whose ids are kept as
    `label_ids` (their text re-encodes to other tokens), rows whose ids could not be kept (named in a warning)."""

    written: int = 0
    truncated: int = 0
    label_ids: int = 0
    ids_not_kept: int = 0

    def summary(self, output: str) -> str:
        return (
            f"wrote {self.written} generated labels to {output}: {self.truncated} cut by --max_new_tokens (marked "
            f"'truncated': trained without an end of turn; raise --max_new_tokens to let them end), {self.label_ids} "
            "whose text re-encodes to other tokens than the target wrote (its ids kept as 'label_ids', which "
            "training uses)" + (f", {self.ids_not_kept} whose ids could not be kept" if self.ids_not_kept else "")
        )


def _generated_line(
    cut, ids: list[int], ends: set[int], renderer: ConversationRenderer, counts: LabelCounts, audio_id: int | None
) -> dict:
    """The output fields of one row: `text`, and `truncated` / `label_ids` where they apply (`counts` counts them).
    `ids`: the target's new tokens (padded with its end token); `renderer`: as training renders the row; `audio_id`:
    the target's audio placeholder."""
    tokenizer = renderer.tokenizer
    end = next((i for i, t in enumerate(ids) if t in ends), None)
    ids = ids if end is None else ids[:end]
    line = {"text": decoded_response(tokenizer, ids)}
    if end is None:
        line[TRUNCATED_KEY] = True
        counts.truncated += 1
    if not line["text"]:
        return line
    custom = {**(cut.custom or {}), LABEL_IDS_KEY: ids, TRUNCATED_KEY: end is None}
    labelled = dataclasses.replace(
        cut, supervisions=[dataclasses.replace(cut.supervisions[0], text=line["text"])], custom=custom
    )
    try:
        problem = generated_problem(labelled, tokenizer, line["text"], audio_id)
        if problem:
            raise ValueError(f"field {problem[0]!r}: {problem[1]}")
        changed = renderer.render(labelled).text_suffix_ids is not None
    except ValueError as e:
        logger.warning(
            "row %r: the target's own ids cannot be kept beside its text (%s); trained on the text", cut.id, e
        )
        counts.ids_not_kept += 1
        return line
    if changed:
        line[LABEL_IDS_KEY] = ids
        counts.label_ids += 1
    return line


_END = object()  # what `next` returns once the prefetched items are used up


def _prefetched(items: Iterator[T]) -> Iterator[T]:
    """`items`, each next one made in a background thread while the caller works on the current one (audio
    decoding and features overlap the target's decoding; the order and any exception are kept)."""
    it = iter(items)
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(next, it, _END)
        while (item := future.result()) is not _END:
            future = pool.submit(next, it, _END)
            yield item


def generate_labels(args: GenerateLabelsArguments) -> LabelCounts:
    """Write the generated-label manifest; returns what the new lines hold."""
    model, processor, family = _load_target(args)
    target = FrozenTarget(model, family.name)
    bad = BadSamples(skip=args.skip_bad_samples)
    conversation = ConversationConfig(args.system_prompt, args.prompt)
    samples = SamplePipeline.build(processor, model.config, family, conversation, bad=bad)  # training's checks
    renderer, validator = samples.renderer, samples.validator
    # decoding and re-rendering here while the prefetch thread encodes with the renderer's tokenizer: a fast tokenizer
    # that sets its padding in one thread can fail ("Already borrowed") while another thread uses it, so use a copy
    check_renderer = ConversationRenderer(copy.deepcopy(processor), family, renderer.config)
    manifest, output = Path(args.manifest), Path(args.output)
    check_output(args.manifest, args.output)
    text_check = UserTextCheck(renderer.tokenizer)
    records = []
    for index, origin, record in json_rows(manifest, bad, id_prefix=manifest_stem(manifest)):
        cut_id = str(record.get("id", f"{manifest_stem(manifest)}-{index:08d}"))
        problem = _record_problem(record, renderer, text_check)
        if problem:
            bad.report(cut_id, *problem, origin=origin)
            continue
        records.append((cut_id, origin, record))
    if args.num_shards > 1:
        total, records = len(records), shard_of(records, args.num_shards, args.shard_index)
        logger.info("shard %d of %d: %d of the %d lines", args.shard_index, args.num_shards, len(records), total)
    earlier = _earlier_lines(output)
    done = _done_ids(earlier)
    todo = [(i, o, r) for i, o, r in records if i not in done]
    logger.info("%d lines in %s, %d already labelled, %d to go", len(records), manifest, len(done), len(todo))

    def batches():  # (size of the chunk, its cuts with their records, their encoded prompts)
        for start in range(0, len(todo), args.batch_size):
            chunk = todo[start : start + args.batch_size]
            cuts = []
            for cut_id, origin, record in chunk:
                if family.has_audio:
                    cut = nemo_line_to_cut(
                        record, cut_id, manifest.parent, bad, origin, allow_programs=args.allow_command_audio_sources
                    )
                else:
                    extras = {k: v for k, v in record.items() if k not in ("text", "lang")}
                    cut = _make_cut(cut_id, None, 0.0, 0.0, record.get("text", ""), record.get("lang"), extras)
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
            yield len(chunk), cuts, _encode(family, processor, model.config, texts, audios) if cuts else []

    ends = target.special_ids().get("eos_token_id", set())
    counts = LabelCounts()
    if not todo and not partial_path(output).exists():
        logger.info("%s is complete: nothing to label", output)
        return counts
    partial = _start_partial(output, earlier)
    with open(partial, "a", encoding="utf-8") as out, tqdm(total=len(todo), desc="generate-labels", unit="utt") as bar:
        for size, cuts, encoded in _prefetched(batches()) if args.prefetch else batches():
            if cuts:
                for (cut, record), ids in zip(cuts, _greedy_new_tokens(target, encoded, args)):
                    line = {k: v for k, v in record.items() if k not in (LABEL_IDS_KEY, TRUNCATED_KEY)}
                    line[args.reference_key] = record.get("text")
                    line.update(_generated_line(cut, ids.tolist(), ends, check_renderer, counts, validator.audio_id))
                    line["id"] = cut.id
                    if "audio_filepath" in record:
                        line["audio_filepath"] = _relocate(record["audio_filepath"], manifest.parent, output.parent)
                    out.write(json.dumps(line, ensure_ascii=False) + "\n")
                    counts.written += 1
                out.flush()
            bar.update(size)
        os.fsync(out.fileno())
    os.replace(partial, output)  # complete: the output appears (or is replaced) in one step
    if bad.num_skipped:
        logger.warning(bad.summary())
    return counts


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    (args,) = parse_with_config(make_parser(), argv)
    print(generate_labels(args).summary(args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
