"""``dflash-generate-labels``: run the frozen target greedily over a NeMo manifest and write a new manifest
whose ``text`` is the target's own response (the original kept under ``reference_key``).

Same audio path / offset / duration / context and every other key; each output line also carries the cut
``id`` so the run is resumable: lines already in the output are skipped, new ones appended.
See docs/GENERATED_LABELS.md.
"""

from __future__ import annotations

import copy
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
from dflash_hf.data.collator import load_cut_audio
from dflash_hf.data.conversation import ConversationConfig, ConversationRenderer, cut_to_messages
from dflash_hf.data.sources import _make_cut, nemo_line_to_cut
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
    skip_bad_samples: bool = field(default=False)
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


def _done_ids(output: Path) -> set[str]:
    """Ids already written; a torn last line (interrupted write) is cut off so appending stays valid."""
    if not output.exists():
        return set()
    raw = output.read_text()
    if raw and not raw.endswith("\n"):
        raw = raw[: raw.rfind("\n") + 1]
        output.write_text(raw)
    return {json.loads(line)["id"] for line in raw.splitlines() if line.strip()}


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
    if family.expansion == "model" or family.prepare_forward is not None:
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


def generate_labels(args: GenerateLabelsArguments) -> int:
    """Write the generated-label manifest; returns the number of new lines written."""
    model, processor, family = _load_target(args)
    target = FrozenTarget(model, family.name)
    renderer = ConversationRenderer(processor, family, ConversationConfig(args.system_prompt, args.prompt))
    # decoding here while the prefetch thread encodes with the renderer's tokenizer: a fast tokenizer that sets its
    # padding in one thread can fail ("Already borrowed") while another thread uses it, so decode with a copy
    tokenizer = copy.deepcopy(renderer.tokenizer)
    manifest, output = Path(args.manifest), Path(args.output)
    bad = BadSamples(skip=args.skip_bad_samples)
    records = []
    for index, line in enumerate(manifest.read_text().splitlines()):
        if line.strip():
            record = json.loads(line)
            records.append((str(record.get("id", f"{manifest.stem}-{index:08d}")), record))
    if args.num_shards > 1:
        total, records = len(records), shard_of(records, args.num_shards, args.shard_index)
        logger.info("shard %d of %d: %d of the %d lines", args.shard_index, args.num_shards, len(records), total)
    done = _done_ids(output)
    todo = [(i, r) for i, r in records if i not in done]
    logger.info("%d lines in %s, %d already labelled, %d to go", len(records), manifest, len(done), len(todo))

    def batches():  # (size of the chunk, its cuts with their records, their encoded prompts)
        for start in range(0, len(todo), args.batch_size):
            chunk = todo[start : start + args.batch_size]
            cuts = []
            for cut_id, record in chunk:
                if family.has_audio:
                    cut = nemo_line_to_cut(record, cut_id, manifest.parent, bad)
                else:
                    extras = {k: v for k, v in record.items() if k not in ("text", "lang")}
                    cut = _make_cut(cut_id, None, 0.0, 0.0, record.get("text", ""), record.get("lang"), extras)
                if cut is not None:
                    cuts.append((cut, record))
            texts = [
                renderer.render_text(cut_to_messages(c, family, renderer.config)[:-1], add_generation_prompt=True)
                for c, _ in cuts
            ]
            audios = [load_cut_audio(c, family.sampling_rate) for c, _ in cuts] if family.has_audio else []
            yield len(chunk), cuts, _encode(family, processor, model.config, texts, audios) if cuts else []

    written = 0
    with open(output, "a") as out, tqdm(total=len(todo), desc="generate-labels", unit="utt") as bar:
        for size, cuts, encoded in _prefetched(batches()) if args.prefetch else batches():
            if cuts:
                for (cut, record), ids in zip(cuts, _greedy_new_tokens(target, encoded, args)):
                    line = dict(record)
                    line[args.reference_key] = record.get("text")
                    line["text"] = tokenizer.decode(ids, skip_special_tokens=True).strip()
                    line["id"] = cut.id
                    if "audio_filepath" in record:
                        line["audio_filepath"] = _relocate(record["audio_filepath"], manifest.parent, output.parent)
                    out.write(json.dumps(line, ensure_ascii=False) + "\n")
                    written += 1
                out.flush()
            bar.update(size)
    if bad.num_skipped:
        logger.warning(bad.summary())
    return written


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    (args,) = parse_with_config(make_parser(), argv)
    written = generate_labels(args)
    print(f"wrote {written} generated labels to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
