"""``dflash-generate-labels``: run the frozen target greedily over a NeMo manifest and write a new manifest
whose ``text`` is the target's own response (the original kept under ``reference_key``).

Same audio path / offset / duration / context and every other key; each output line also carries the cut
``id`` so the run is resumable: rows already in the output are not labelled again (an output holding rows of
another manifest or shard is refused). A row whose text does not re-encode to the tokens the target wrote keeps
them as ``label_ids``, and an output cut by ``--max_new_tokens`` before the target's end is marked ``truncated``
(``dflash_hf.data.generated``; training takes both into account).
The output is never written in place: the lines go to ``<output>.partial`` (kept by an interrupted run, and resumed
from), renamed over ``--output`` once complete; an output that is the input manifest is refused. See
docs/GENERATED_LABELS.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial

from transformers import HfArgumentParser

from dflash_hf.cli.config import parse_with_config
from dflash_hf.data.label_manifest import LabelJob, check_label_inputs, write_generated_labels
from dflash_hf.data.label_rows import LabelCounts
from dflash_hf.generation.target_generate import generated_labels
from dflash_hf.settings.labels import LabelSettings
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.targets.processor import load_label_target


@dataclass
class GenerateLabelsArguments(LabelSettings):
    """The options (`LabelSettings`), the files they name checked when parsed (`check_label_inputs`, whose reading of
    the target's config is kept in `label_target`)."""

    label_target: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        self.label_target = check_label_inputs(self)


def make_parser() -> HfArgumentParser:
    return HfArgumentParser(GenerateLabelsArguments)


def generate_labels(args: LabelSettings, label_target: tuple | None = None) -> LabelCounts:
    """Write the generated-label manifest; returns what the new lines hold. `label_target`: the target's `(config,
    family row)` when `check_label_inputs` has read it (None: read here)."""
    model, processor, family = load_label_target(args.model, args.family, args.dtype, args.device, label_target)
    target = FrozenTarget(model, family.name)
    decode = partial(generated_labels, target, max_new_tokens=args.max_new_tokens, device=args.device)
    return write_generated_labels(LabelJob.of(args), target, processor, decode)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    (args,) = parse_with_config(make_parser(), argv)
    print(generate_labels(args, args.label_target).summary(args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
