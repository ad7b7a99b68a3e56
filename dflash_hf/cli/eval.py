"""`dflash-eval`: real acceptance length (tau) and tokens/s of speculative decoding against the target's own
greedy decoding (`generate`) on the same prompts; greedy outputs must be identical.

    dflash-eval --draft runs/x/draft --target /models/qwen3-asr --data dev.jsonl --max_new_tokens 128
    dflash-eval --config eval.yaml --num_samples 50

`--data` is a NeMo manifest (or lhotse cuts file): each prompt is the conversation up to the assistant turn,
rendered and processed exactly as in training; or, for text targets, JSON lines of prompts:
`{"prompt": "raw text"}` (tokenized as is) or `{"messages": [...]}` (chat template + generation prompt).

A manifest's conversations take the settings the draft was trained with, recorded in its export (user prompt, system
prompt, cut fields, family row): `--prompt`, `--system_prompt` and `--family` left out take the recorded values; given
ones that differ override them with a warning (tau then measures prompts the draft was not trained on).

The results JSON is written beside the draft, `<draft>/eval_<data name>.json` (`--output_json` elsewhere); an existing
results file is refused before anything loads unless `--overwrite_output_json true`.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

from dflash_hf.cli.config import check_paths_exist, parse_with_config
from dflash_hf.data.eval_rows import evaluation_prompts, recorded_conversation
from dflash_hf.data.text_prompts import count_records, is_text_prompts
from dflash_hf.export.draft_target import check_draft_target, draft_on_target
from dflash_hf.export.drafts import load_draft_strict, resolve_draft_dir
from dflash_hf.export.training_record import TRAINING_RECORD_FILE, read_training_record, recorded_or_given
from dflash_hf.generation.decode_options import DecodeOptions
from dflash_hf.generation.evaluation import decode_benchmark
from dflash_hf.generation.tree_verify import check_tree_target
from dflash_hf.ops.cpu_threads import configure_cpu_threads
from dflash_hf.settings import DataSettings, ModelSettings
from dflash_hf.settings.decode import DecodeSettings
from dflash_hf.targets.frozen import FrozenTarget, load_target, resolve_dtype
from dflash_hf.targets.processor import check_model_dir, load_processor

logger = logging.getLogger("dflash_hf")


@dataclass
class EvalArguments(DecodeSettings):
    """The options of `dflash-eval` (the decoding switches are `DecodeSettings`')."""

    draft: str = field(metadata={"help": "Draft export directory (dflash-train's export or save_pretrained)."})
    target: str = field(
        metadata={"help": "The frozen target (model + processor or tokenizer): a local directory or a Hub id."}
    )
    data: str = field(
        metadata={"help": "NeMo manifest / lhotse cuts file, or JSON lines of text prompts ('prompt' or 'messages')."}
    )
    output_json: str | None = field(
        default=None,
        metadata={
            "help": "Where the results JSON is written; default: beside the draft, <draft>/eval_<data name>.json "
            "(e.g. runs/x/draft/eval_dev.json for --data dev.jsonl). An existing file is refused unless "
            "--overwrite_output_json true."
        },
    )
    overwrite_output_json: bool = field(
        default=False, metadata={"help": "Replace an existing results file (default: refuse it before decoding)."}
    )
    max_new_tokens: int = field(default=128, metadata={"help": "Tokens decoded per prompt (both decoders)."})
    num_samples: int = field(default=0, metadata={"help": "Prompts to decode from the start of --data; 0 = all."})
    precision: str = field(
        default=ModelSettings.precision, metadata={"help": "Parameter dtype of target and draft: fp32 or bf16."}
    )
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N or auto (cuda when available)."})
    family: str | None = field(
        default=None,
        metadata={
            "help": "Target family row (dflash_hf.targets.families.registry); default: the one the draft was "
            "trained with (recorded in its export), else from the target's config."
        },
    )
    prompt: str | None = field(
        default=None,
        metadata={
            "help": "Default user text of manifest conversations; default: the training run's, recorded in the "
            "draft export. An empty string decodes without one."
        },
    )
    system_prompt: str | None = field(
        default=None,
        metadata={
            "help": "System turn of manifest conversations; default: the training run's, recorded in the draft "
            "export. An empty string decodes without one."
        },
    )
    allow_command_audio_sources: bool = field(
        default=DataSettings.allow_command_audio_sources,
        metadata={
            "help": "Let programs read audio: lhotse cuts of type 'command', and decoders (ffmpeg through audioread) "
            "for files libsndfile cannot read. Only for data you trust (default: such a row is an error)."
        },
    )
    allow_mismatch: bool = field(
        default=False,
        metadata={"help": "Exit 0 even if speculative and greedy outputs differ (expected only from bf16 noise)."},
    )
    tree_budget: list[int] = field(
        default_factory=list,
        metadata={
            "help": "Also decode every prompt with tree verification of these node budgets (e.g. 8 16 32 64), "
            "beside the chain on the same prompts in the same run: tau, tokens/s, target forwards and output "
            "identity of each, under 'tree' in the JSON (dflash_hf.generation.tree_decode)."
        },
    )
    allow_target_mismatch: bool = field(
        default=False,
        metadata={
            "help": "Evaluate a draft against a target other than the one it was trained for (another vocabulary, "
            "or weights other than those its export's run record names); refused without it. The differences are "
            "recorded in the results (target_check)."
        },
    )

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0 (0 = all), got {self.num_samples}")
        bad_budgets = [b for b in self.tree_budget if b < 1]
        if bad_budgets or len(set(self.tree_budget)) != len(self.tree_budget):
            raise ValueError(
                f"--tree_budget takes distinct node budgets >= 1 (e.g. 8 16 32 64), got {list(self.tree_budget)}"
            )
        resolve_dtype(self.precision)
        super().__post_init__()

    def check_inputs(self) -> None:
        """The draft and data exist and the target is an existing directory or a Hub id (before anything loads)."""
        check_paths_exist(self, ("draft", "data"))
        check_model_dir(self.target, "--target", "the frozen target")


DATA_SUFFIXES = (".gz", ".jsonl", ".json")  # stripped from --data's file name for the default results name


def results_path(args: EvalArguments) -> Path:
    """`--output_json`, else `<draft>/eval_<data name>.json` (the data file's name without its suffixes)."""
    if args.output_json:
        return Path(args.output_json)
    name = Path(args.data).name
    for suffix in DATA_SUFFIXES:
        name = name.removesuffix(suffix)
    return Path(args.draft) / f"eval_{name or 'data'}.json"


def check_results_path(args: EvalArguments) -> None:
    """The results file is not a directory, is not written over unless `--overwrite_output_json true`, and its
    folder is writable: refused before anything loads, not after the decoding."""
    out = results_path(args)
    if out.is_dir():
        raise IsADirectoryError(f"--output_json {out} is a directory; give a file name (e.g. {out}/eval.json)")
    if out.exists() and not args.overwrite_output_json:
        raise FileExistsError(
            f"--output_json {out} exists (an earlier evaluation's results); pass --overwrite_output_json true to "
            "replace it, or --output_json NEW.json"
        )
    folder = next((p for p in out.absolute().parents if p.exists()), None)
    if folder is not None and not os.access(folder, os.W_OK):
        raise PermissionError(f"--output_json {out}: {folder} is not writable; give --output_json in a folder you own")


def make_parser() -> HfArgumentParser:
    return HfArgumentParser(EvalArguments)


def _no_text(value: str | None) -> str | None:
    """An empty prompt is no prompt (the conversation leaves out an empty user text or system turn)."""
    return value or None


def apply_recorded_conversation(args: EvalArguments, recorded: dict | None) -> dict | None:
    """Fill `--prompt`, `--system_prompt` and `--family` left out (None) from the conversation recorded in the draft's
    export (`recorded`: its training record's), and warn about each given one that differs from it, about a draft that
    records none (a manifest's prompts are then rendered from the flags alone) and about text prompts (rendered as they
    are, without the recorded settings). Returns the recorded conversation (None when there is none)."""
    text = is_text_prompts(args.data)
    where = f"{args.draft}/{TRAINING_RECORD_FILE}"
    if recorded is None:
        if not text:
            logger.warning(
                "the draft export %s records no conversation settings (exported before they were recorded, or "
                "trained on rows collated outside dflash-train): its prompts are rendered with --prompt %r and "
                "--system_prompt %r as given; they must be the training run's for tau to measure what the draft "
                "learned",
                args.draft,
                args.prompt,
                args.system_prompt,
            )
        return None
    if text:
        if _no_text(recorded["prompt"]) or _no_text(recorded["system_prompt"]):
            logger.warning(
                "--data %s holds text prompts, rendered as they are: the conversation the draft was trained with "
                "(prompt %r, system prompt %r, recorded in %s) is not applied to them",
                args.data,
                recorded["prompt"],
                recorded["system_prompt"],
                where,
            )
    resolved = recorded_or_given(recorded, prompt=args.prompt, system_prompt=args.system_prompt, family=args.family)
    for name, what in (("prompt", "user prompt"), ("system_prompt", "system prompt"), ("family", "family row")):
        given, trained = getattr(args, name), recorded[name]
        setattr(args, name, resolved[name])
        if given is None:
            continue
        if (given if name == "family" else _no_text(given)) != (trained if name == "family" else _no_text(trained)):
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


def load_evaluation(args: EvalArguments) -> tuple[torch.device, FrozenTarget, torch.nn.Module, Iterator[dict], int]:
    """The device, the frozen target, the draft (checked against the target), the prompts (lazily, at most
    `num_samples`) and their count at most (a row without an assistant response gives no prompt)."""
    args.check_inputs()
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    draft = load_draft_strict(args.draft)
    recorded = read_training_record(resolve_draft_dir(args.draft)).conversation
    recorded = apply_recorded_conversation(args, recorded)  # before the family is resolved
    target = FrozenTarget(load_target(args.target, args.precision).to(device), args.family)
    draft = draft_on_target(draft, target, resolve_dtype(args.precision))
    prompts = evaluation_prompts(
        args.data,
        load_processor(args.target),
        target.model.config,
        family=args.family,
        conversation=recorded_conversation(recorded, prompt=args.prompt, system_prompt=args.system_prompt),
        allow_command_audio_sources=args.allow_command_audio_sources,
    )
    total = count_records(args.data)
    if args.num_samples:
        prompts = itertools.islice(prompts, args.num_samples)
        total = min(total, args.num_samples)
    return device, target, draft, prompts, total


def evaluate(args: EvalArguments) -> dict:
    """Decode the prompts both ways; returns the results written to `args.output_json`."""
    device, target, draft, prompts, total = load_evaluation(args)
    if args.tree_budget:  # a target that cannot take tree verification: refused before any decoding
        check_tree_target(target)
    cfg = draft.config
    target_check = check_draft_target(  # before any decoding: a draft of another target is refused
        args.draft, cfg, target, allow_mismatch=args.allow_target_mismatch, target_name=args.target
    )
    stats = decode_benchmark(
        draft,
        target,
        prompts,
        args.max_new_tokens,
        progress=True,
        total=total,
        options=DecodeOptions.from_settings(args),
        tree_budgets=args.tree_budget,
    )
    if stats.prompts == 0:
        raise ValueError(f"--data {args.data!r} gave no prompt (no row with an assistant response to cut before)")
    return {
        **stats.as_dict(),
        "per_slot_acceptance": stats.per_slot_acceptance(cfg.block_size),
        "block_size": cfg.block_size,
        "device": str(device),
        "draft_step": _ways(stats.draft_steps),
        "verify_step": _ways(stats.verify_steps),
        "conversation_recorded": read_training_record(resolve_draft_dir(args.draft)).conversation,  # as used
        "target_check": target_check,
        **asdict(args),
    }


def _ways(steps: dict[str, int]) -> str:
    """How a step ran over the prompts (auto falls back to eager where the fixed shape cannot run)."""
    return next(iter(steps)) if len(steps) == 1 else ", ".join(f"{k}: {n} prompts" for k, n in steps.items())


def results_table(results: dict) -> str:
    rows = [
        f"{'decoder':<16} {'tokens':>8} {'tokens/s':>10}",
        f"{'speculative':<16} {results['spec_tokens']:>8} {results['spec_tokens_per_s']:>10.1f}",
        f"{'target greedy':<16} {results['greedy_tokens']:>8} {results['greedy_tokens_per_s']:>10.1f}",
        f"prompts {results['prompts']}, block size {results['block_size']}, draft step {results['draft_step']}, "
        f"verify {results['verify_step']}, tau {results['tau']:.3f} "
        f"(mean acceptance length over {results['cycles']} cycles), speedup {results['speedup']:.2f}x, "
        f"outputs identical: {'yes' if results['outputs_identical'] else 'NO'}",
        "slot k accepted (k = 1..block_size-1): " + " ".join(f"{a:.3f}" for a in results["per_slot_acceptance"]),
    ]
    for budget, tree in results.get("tree", {}).items():  # tree verification beside the chain (`--tree_budget`)
        speed = tree["spec_tokens_per_s"] / results["spec_tokens_per_s"]
        rows.append(
            f"tree {budget:>4}: tau {tree['tau']:.3f} ({tree['tau'] / results['tau']:.2f}x the chain's), "
            f"{tree['spec_tokens_per_s']:.1f} tokens/s ({speed:.2f}x), target forwards {tree['target_forwards']} "
            f"(chain {results['target_forwards']}), outputs identical: {'yes' if tree['outputs_identical'] else 'NO'}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    (args,) = parse_with_config(make_parser(), argv)
    configure_cpu_threads()
    args.check_inputs()
    check_results_path(args)
    out = results_path(args)
    args.output_json = str(out)  # the results record where they were written
    results = evaluate(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(results_table(results))
    print(f"results written to {out}")
    if not results["outputs_identical"] and not args.allow_mismatch:
        print(
            f"speculative output differs from target greedy on prompts {results['mismatched_prompts']}: greedy "
            "speculative decoding must be lossless (pass --allow_mismatch true to accept bf16 noise)"
        )
        return 1
    trees = {
        b: tree["mismatched_prompts"] for b, tree in results.get("tree", {}).items() if not tree["outputs_identical"]
    }
    if trees and not args.allow_mismatch:
        print(
            f"tree-verified output differs from target greedy (prompts per tree budget: {trees}): tree decoding "
            "must be lossless too (pass --allow_mismatch true to accept bf16 noise)"
        )
        return 1
    return 0


if __name__ == "__main__":
    from dflash_hf.cli.console import evaluate

    evaluate()
