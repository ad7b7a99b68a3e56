"""Which tokens a draft misses: the first rejected slot of every draft/verify cycle, by kind of token.

    python benchmarks/draft_misses.py --draft runs/whisper-ctx-dflash2-b8/draft --target whisper-base/hf \
        --data data/speech/eval.json --num_samples 8 --device cpu

Greedy speculative decoding of each prompt (`dflash_hf.speculative_generate`, the prompts `dflash-eval` builds from
`--data`). For every cycle that stops before its block's end, the target's token at the first rejected slot (its
correction) and what the draft proposed there. The target's token is classed as `end` (an end token),
`punctuation` (no letter or digit), `word start` (begins with a space, or the first new token) or `word piece` (the
rest of a word); `capitalized` counts corrections whose first letter is upper case. A proposal that equals the
target's token one slot later (`skipped`: the draft left out a token) or one slot earlier (`repeated`) is counted
too: it says the draft lost its place in the audio or text rather than choosing between words. Results as JSON
(`--output_json`) and a table.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import HfArgumentParser

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: the checkout's package
    sys.path.insert(0, str(REPO))

from dflash_hf.data.eval_rows import evaluation_prompts, recorded_conversation  # noqa: E402
from dflash_hf.export.drafts import load_draft_strict  # noqa: E402
from dflash_hf.generation import speculative  # noqa: E402
from dflash_hf.generation.target_generate import generate_inputs  # noqa: E402
from dflash_hf.generation.verify_rules import eos_token_ids  # noqa: E402
from dflash_hf.settings.checks import check_paths_exist  # noqa: E402
from dflash_hf.targets.families.base import get_tokenizer  # noqa: E402
from dflash_hf.targets.frozen import FrozenTarget, load_target, resolve_dtype  # noqa: E402
from dflash_hf.targets.processor import check_model_dir, load_processor  # noqa: E402

KINDS = ("end", "punctuation", "word start", "word piece")


@dataclass
class MissArguments:
    draft: str = field(metadata={"help": "Draft export directory."})
    target: str = field(
        metadata={"help": "The frozen target (model + processor or tokenizer): a Hub id or a local directory."}
    )
    data: str = field(metadata={"help": "What dflash-eval reads: a NeMo manifest, or JSON lines of prompts."})
    num_samples: int = field(default=8, metadata={"help": "Prompts decoded from the start of --data."})
    max_new_tokens: int = field(default=128, metadata={"help": "Tokens decoded per prompt."})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or cuda:N."})
    precision: str = field(default="fp32", metadata={"help": "fp32 or bf16."})
    family: str | None = field(default=None, metadata={"help": "Target family row override."})
    prompt: str | None = field(default=None, metadata={"help": "Speech targets: the user text before the audio."})
    output_json: str | None = field(default=None, metadata={"help": "Where the counts go (JSON)."})

    def __post_init__(self):
        if self.num_samples < 1:
            raise ValueError(f"--num_samples must be >= 1, got {self.num_samples}")
        resolve_dtype(self.precision)
        check_paths_exist(self, ("draft", "data"))
        check_model_dir(self.target, "--target", "the frozen target")


def make_parser() -> HfArgumentParser:
    return HfArgumentParser(MissArguments)


def token_kind(text: str, is_end: bool, first: bool) -> str:
    """The class of one decoded token (see the module docstring)."""
    if is_end:
        return "end"
    if not any(c.isalnum() for c in text):
        return "punctuation"
    return "word start" if first or text.startswith(" ") else "word piece"


def decode_recording(draft, ft: FrozenTarget, max_new_tokens: int, inputs: dict):
    """`(output, [(proposal ids, accepted count) per cycle])` of one greedy speculative decode."""
    cycles = []
    accept = speculative.accept_prefix

    def recording(proposal, *args):
        k, new, new_ids = accept(proposal, *args)
        cycles.append((proposal.tolist(), k))
        return k, new, new_ids

    speculative.accept_prefix = recording
    try:
        out = speculative.speculative_generate(draft, ft, max_new_tokens, **inputs)
    finally:
        speculative.accept_prefix = accept
    return out, cycles


def misses(sequence: list[int], start: int, cycles: list[tuple[list[int], int]], kept: list[int]):
    """First-rejected-slot records of one decode: `sequence` the output ids, `start` the index of the first anchor
    (the last prompt token's successor, the prefill's token), `kept` the tokens each cycle kept."""
    anchor = start
    for (proposal, k), n in zip(cycles, kept):
        slot = anchor + 1 + k  # the rejected slot's index in the output
        if k < len(proposal) and slot < len(sequence) and n == k + 1:  # rejected (not cut by a stop token)
            yield {
                "target": sequence[slot],
                "draft": proposal[k],
                "slot": k + 1,
                "first": slot == start + 1,
                "skipped": slot + 1 < len(sequence) and proposal[k] == sequence[slot + 1],
                "repeated": proposal[k] == sequence[slot - 1],
            }
        anchor += n


def run(args: MissArguments) -> dict:
    device = torch.device(args.device)
    ft = FrozenTarget(load_target(args.target, args.precision).to(device), args.family)
    draft = load_draft_strict(args.draft).to(device=device, dtype=resolve_dtype(args.precision)).eval()
    processor = load_processor(args.target)
    tokenizer = get_tokenizer(processor)
    conversation = recorded_conversation(None, prompt=args.prompt)  # as dflash-eval renders a manifest's rows
    prompts = evaluation_prompts(args.data, processor, ft.model.config, family=args.family, conversation=conversation)
    prompts = itertools.islice(prompts, args.num_samples)
    ends = set(eos_token_ids(ft))
    kinds, capitalized, skipped, repeated, slots, cycles_total, records = Counter(), 0, 0, 0, Counter(), 0, []
    with torch.no_grad():
        for inputs in tqdm(prompts, total=args.num_samples, desc="draft misses"):
            inputs = generate_inputs(ft, inputs)
            out, cycles = decode_recording(draft, ft, args.max_new_tokens, inputs)
            sequence = out.sequences[0].tolist()
            start = len(sequence) - sum(out.acceptance_lengths) - 1
            cycles_total += len(cycles)
            for m in misses(sequence, start, cycles, out.acceptance_lengths):
                text = tokenizer.decode([m["target"]])
                kind = token_kind(text, m["target"] in ends, m["first"])
                kinds[kind] += 1
                slots[m["slot"]] += 1
                capitalized += next((c.isupper() for c in text if c.isalpha()), False)
                skipped += m["skipped"]
                repeated += m["repeated"]
                records.append({**m, "target_text": text, "draft_text": tokenizer.decode([m["draft"]]), "kind": kind})
    total = sum(kinds.values())
    return {
        "cycles": cycles_total,
        "misses": total,
        "by_kind": {k: kinds[k] for k in KINDS},
        "capitalized": capitalized,
        "skipped": skipped,
        "repeated": repeated,
        "by_slot": dict(sorted(slots.items())),
        "records": records,
        "args": asdict(args),
    }


def table(results: dict) -> str:
    total = max(results["misses"], 1)
    rows = [
        f"{results['misses']} rejected cycles of {results['cycles']}; the target's token at the first rejected slot:"
    ]
    rows += [f"  {k:<12} {v:>5}  {100 * v / total:5.1f}%" for k, v in results["by_kind"].items()]
    rows += [
        f"  {k:<12} {results[k]:>5}  {100 * results[k] / total:5.1f}%" for k in ("capitalized", "skipped", "repeated")
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    (args,) = make_parser().parse_args_into_dataclasses(argv)
    results = run(args)
    print(table(results))
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
