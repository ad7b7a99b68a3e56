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

import logging
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from transformers import HfArgumentParser

from dflash_hf.cli.config import parse_with_config
from dflash_hf.data.label_manifest import LabelJob, write_generated_labels
from dflash_hf.data.label_rows import LabelCounts, check_manifest, check_output
from dflash_hf.generation.target_greedy import greedy_labels
from dflash_hf.settings import DataSettings
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.targets.processor import check_model_dir, load_greedy_target


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


def make_parser() -> HfArgumentParser:
    return HfArgumentParser(GenerateLabelsArguments)


def generate_labels(args: GenerateLabelsArguments) -> LabelCounts:
    """Write the generated-label manifest; returns what the new lines hold."""
    model, processor, family = load_greedy_target(args.model, args.family, args.dtype, args.device)
    target = FrozenTarget(model, family.name)
    decode = partial(greedy_labels, target, max_new_tokens=args.max_new_tokens, device=args.device)
    return write_generated_labels(LabelJob.of(args), target, processor, decode)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    (args,) = parse_with_config(make_parser(), argv)
    print(generate_labels(args).summary(args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
