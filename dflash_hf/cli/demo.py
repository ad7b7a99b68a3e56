"""`dflash-demo`: the embedded default job, end to end on CPU in a few minutes, with nothing downloaded.

1. builds a tiny Qwen3-ASR-style target and its byte-level tokenizer/processor locally;
2. synthesizes a speech set (tone "words") with soundfile, writes NeMo manifests, and teaches the tiny target to
   transcribe it (a plain causal-LM loss on the transcripts), so that it writes what it hears, like a small ASR model
   (`dflash_hf.testing.demo_assets`);
3. trains a DFlash draft against the frozen target with `DFlashTrainer` (`dflash-train` settings from
   `examples/configs/demo.yaml`, overridable on the command line);
4. exports it with `save_pretrained`, measures the target's word error rate and real speculative decoding on held-out
   utterances (tau, tokens/s against the target's own greedy decoding, outputs identical), and prints a summary
   ending in the `dflash-train` command that reproduces the draft's recipe on the demo's assets.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from transformers import HfArgumentParser

from dflash_hf.cli.config import apply_config, option_actions, parse_with_config
from dflash_hf.cli.train import train
from dflash_hf.data.eval_rows import prompts_and_references
from dflash_hf.data.wer import corpus_wer
from dflash_hf.generation.evaluation import decode_benchmark
from dflash_hf.generation.target_generate import target_transcripts
from dflash_hf.ops.cpu_threads import configure_cpu_threads
from dflash_hf.testing.demo_assets import build_demo_assets
from dflash_hf.training.launch import no_hf_progress_bars
from dflash_hf.training.training_args import DFlashDataArguments, DFlashTrainingArguments

DEMO_THREADS = 1
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "demo.yaml"


@dataclass
class DemoArguments:
    num_train_utterances: int = field(default=1000, metadata={"help": "Synthetic training utterances."})
    num_dev_utterances: int = field(
        default=40, metadata={"help": "Held-out utterances (validation, decoding and the target's WER)."}
    )
    target_hidden_size: int = field(default=64, metadata={"help": "Hidden size of the tiny target."})
    target_num_heads: int = field(
        default=1,
        metadata={
            "help": "Attention heads of the tiny target (head_dim = hidden size / heads; vLLM's attention "
            "backends need head_dim >= 64 to serve it)."
        },
    )
    target_num_layers: int = field(default=6, metadata={"help": "Decoder layers of the tiny target."})
    decode_prompts: int = field(default=8, metadata={"help": "Held-out prompts decoded speculatively."})
    decode_max_new_tokens: int = field(default=48, metadata={"help": "New tokens per decoded prompt."})
    target_teach_steps: int = field(
        default=800, metadata={"help": "Steps teaching the tiny target to transcribe (0: leave it random)."}
    )
    target_teach_learning_rate: float = field(
        default=3e-3,
        metadata={"help": "Peak AdamW learning rate of the teaching steps (warm-up over a tenth, cosine decay)."},
    )
    target_teach_max_tokens: int = field(
        default=1500, metadata={"help": "Token budget of one teaching batch (audio positions + text)."}
    )

    def __post_init__(self):
        if self.target_num_heads < 1 or self.target_hidden_size % self.target_num_heads:
            raise ValueError(
                f"target_hidden_size {self.target_hidden_size} must be a multiple of target_num_heads "
                f"{self.target_num_heads} (head_dim = hidden size / heads)"
            )


def make_parser() -> HfArgumentParser:
    return HfArgumentParser((DemoArguments, DFlashTrainingArguments, DFlashDataArguments))


def with_default_config(argv: list[str] | None) -> list[str]:
    """`argv` with `--config examples/configs/demo.yaml` first unless it names a config."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" in argv:
        return argv
    if not DEFAULT_CONFIG.is_file():
        raise FileNotFoundError(f"{DEFAULT_CONFIG} not found (not a repo checkout?): pass --config demo.yaml")
    return ["--config", str(DEFAULT_CONFIG), *argv]


def use_assets(args, data_args, target_dir: Path, train: Path, dev: Path, mask_id: int) -> None:
    """Point the run's settings at the demo's target, its mask token and its manifests."""
    args.target_name_or_path = str(target_dir)
    args.mask_token_id = mask_id
    data_args.train_data = [str(train)]
    data_args.eval_data = [f"dev={dev}"]


def run(argv: list[str] | None = None) -> dict:
    argv = with_default_config(argv)
    demo, args, data_args = parse_with_config(make_parser(), argv)
    root = Path(args.output_dir)
    with no_hf_progress_bars():  # save_pretrained's "Writing model shards" bar
        assets = build_demo_assets(
            root / "assets",
            num_train_utterances=demo.num_train_utterances,
            num_dev_utterances=demo.num_dev_utterances,
            hidden_size=demo.target_hidden_size,
            num_layers=demo.target_num_layers,
            num_heads=demo.target_num_heads,
            teach_steps=demo.target_teach_steps,
            teach_learning_rate=demo.target_teach_learning_rate,
            teach_max_tokens=demo.target_teach_max_tokens,
            prompt=data_args.prompt,
        )
    use_assets(args, data_args, assets.target_dir, assets.train_manifest, assets.dev_manifest, assets.mask_token_id)
    command = train_command(argv, args, data_args)  # before the run: train() changes a few settings it acts on
    metrics = train(args, data_args)

    from dflash_hf.export.drafts import load_draft_strict
    from dflash_hf.targets.frozen import FrozenTarget, load_target
    from dflash_hf.targets.processor import load_processor

    draft = load_draft_strict(args.resolved_export_dir).eval()
    target = FrozenTarget(load_target(args.target_name_or_path))
    processor = load_processor(args.target_name_or_path)
    rows = prompts_and_references(
        assets.dev_manifest,
        processor,
        target.model.config,
        max_tokens=data_args.max_tokens,
        conversation=data_args.conversation(),
    )
    prompts = [prompt for prompt, _ in rows]
    transcripts = target_transcripts(target, processor, prompts, demo.decode_max_new_tokens)
    references = [reference for _, reference in rows]
    decode_set = prompts[: demo.decode_prompts]
    stats = decode_benchmark(
        draft, target, decode_set, demo.decode_max_new_tokens, progress=True, total=len(decode_set)
    )
    summary = {
        "export_dir": args.resolved_export_dir,
        "block_size": draft.config.block_size,
        "eval_dev_tau": metrics.get("eval_dev_tau"),
        "eval_dev_loss": metrics.get("eval_dev_loss"),
        "eval_dev_tau_est": metrics.get("eval_dev_tau_est"),
        **{f"decode_{k}": v for k, v in stats.as_dict().items()},
        "target_wer": corpus_wer(references, transcripts),
        "target_wer_utterances": len(rows),
        "target_example": {"reference": references[0], "transcript": transcripts[0]},
        "target_dir": str(assets.target_dir),
        "train_manifest": str(assets.train_manifest),
        "dev_manifest": str(assets.dev_manifest),
        "mask_token_id": assets.mask_token_id,
        "train_command": shlex.join(command),
    }
    (root / "demo_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(summary_text(summary, command))
    return summary


def summary_text(summary: dict, command: list[str]) -> str:
    """The demo's closing report: results, what the speed figures mean here, and the next step."""
    example = summary["target_example"]
    return "\n".join(
        [
            "",
            "=== dflash_hf demo ===",
            f"target              WER {summary['target_wer']:.1%} on {summary['target_wer_utterances']} held-out "
            f"utterances (its greedy transcripts), e.g. {example['reference']!r} -> {example['transcript']!r}",
            f"draft exported to   {summary['export_dir']} (block size {summary['block_size']})",
            validation_line(summary),
            f"speculative decode  tau {summary['decode_tau']:.2f} (accepted tokens + 1 per draft/verify cycle, over "
            f"{summary['decode_cycles']} cycles), outputs identical to greedy: "
            f"{summary.get('decode_outputs_identical')}",
            f"speed               {summary['decode_spec_tokens_per_s']:.0f} tok/s speculative vs "
            f"{summary.get('decode_greedy_tokens_per_s', 0):.0f} tok/s greedy",
            "  The target here is tiny and on CPU: a target forward costs about as much as a draft forward and Python",
            "  overhead dominates, so these tokens/s say nothing about real speed (speculative decoding can even be",
            "  slower than greedy here). tau is what carries over; speedups need a real target, see docs/QUALITY.md.",
            "reusable assets (the next step is dflash-train on them, or on your own target and manifests):",
            f"  target + processor  {summary['target_dir']}",
            f"  train manifest      {summary['train_manifest']}",
            f"  dev manifest        {summary['dev_manifest']}",
            "the demo's draft recipe on them, as a dflash-train command:",
            wrapped(command),
        ]
    )


def validation_line(summary: dict) -> str:
    """The validation's real tau first (the estimate that predicts decoding), then the teacher-forced figures."""
    forced = f"loss {summary['eval_dev_loss']:.3f}, teacher-forced tau_est {summary['eval_dev_tau_est']:.2f}"
    if summary.get("eval_dev_tau") is None:
        return f"validation          {forced}"
    return f"validation          tau {summary['eval_dev_tau']:.2f} (real decoding of dev prompts; {forced})"


# Run management, not recipe: the next step trains into a directory of its own (NEXT_OUTPUT_DIR), without replacing it.
NOT_RECIPE = ("output_dir", "overwrite_output_dir")
NEXT_OUTPUT_DIR = "runs/my-first-draft"


def train_command(argv: list[str], args, data_args) -> list[str]:
    """`dflash-train` with every setting of the demo's run that differs from dflash-train's defaults (from the config
    file and the command line, as parsed), its target, mask token and manifests (`args`, `data_args`), and an output
    directory of its own: parsing it gives the demo's run's settings but for `NOT_RECIPE`."""
    from dflash_hf.cli.train import make_parser as train_parser

    parser = train_parser()
    for action in parser._actions:
        action.required = False
    parsed_defaults = vars(parser.parse_args([]))  # as parsed: argparse converts string defaults with their type
    defaults = {dest: parsed_defaults[dest] for dest in option_actions(parser)}
    demo_parser = make_parser()
    given = vars(demo_parser.parse_args(apply_config(demo_parser, argv)))
    given.update(
        target_name_or_path=args.target_name_or_path,
        mask_token_id=args.mask_token_id,
        train_data=data_args.train_data,
        eval_data=data_args.eval_data,
    )
    first = ("target_name_or_path", "train_data", "eval_data", "mask_token_id")
    order = [*first, *(dest for dest in defaults if dest not in first)]
    words = ["dflash-train"]
    for dest in order:
        if dest in NOT_RECIPE or _flag_words(given[dest]) == _flag_words(defaults[dest]):
            continue
        words += [f"--{dest}", *_flag_words(given[dest])]
    return [*words, "--output_dir", NEXT_OUTPUT_DIR]


def _flag_words(value) -> list[str]:
    """A setting as the command line spells it (one word, or one per item of a list)."""
    if isinstance(value, (list, tuple)):
        return [w for item in value for w in _flag_words(item)]
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, Enum):
        return [str(value.value)]
    if isinstance(value, dict):
        return [json.dumps(value)]
    if isinstance(value, float) and value.is_integer():
        return [str(int(value))]  # `--logging_steps 50` (a float option) parses back to 50.0
    return [str(value)]


def wrapped(command: list[str], width: int = 100) -> str:
    """A shell command over several lines (backslash continuations), options kept with their values."""
    pieces: list[str] = []
    for word in command:
        if word.startswith("--") or not pieces:
            pieces.append(shlex.quote(word))
        else:
            pieces[-1] += " " + shlex.quote(word)
    lines = [""]
    for piece in pieces:
        if lines[-1] and len(lines[-1]) + len(piece) + 1 > width:
            lines.append("")
        lines[-1] = f"{lines[-1]} {piece}" if lines[-1] else piece
    return "  " + " \\\n      ".join(lines)


def main(argv: list[str] | None = None) -> int:
    # One thread (OMP_NUM_THREADS overrides): the tiny models' ops are too small to split; a second thread
    # took 1.8x the CPU time for the same wall time on 2 cores, and oversubscribed them under load.
    configure_cpu_threads(max_threads=DEMO_THREADS)
    from dflash_hf.training.step_guards import TrainingInterrupted

    try:
        run(argv)
    except TrainingInterrupted as stop:  # SIGTERM / SIGINT while training: as dflash-train, one line, 128 + signal
        print(f"dflash-demo: {stop}", file=sys.stderr)
        return stop.exit_code
    return 0


if __name__ == "__main__":
    from dflash_hf.cli.console import demo

    demo()
