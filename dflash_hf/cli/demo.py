"""`dflash-demo`: the embedded default job, end to end on CPU in a few minutes, with nothing downloaded.

1. builds a tiny Qwen3-ASR-style target and its byte-level tokenizer/processor locally;
2. synthesizes a small speech set (tone "words") with soundfile, writes NeMo manifests, and teaches the
   tiny target to transcribe it for a minute (so its outputs are structured, like a real ASR model's);
3. trains a DFlash draft against the frozen target with `DFlashTrainer` (`dflash-train` settings from
   `examples/configs/demo.yaml`, overridable on the command line);
4. exports it with `save_pretrained` and measures real speculative decoding on held-out utterances
   (tau, tokens/s against the target's own greedy decoding, outputs identical) and prints a summary.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import HfArgumentParser

from dflash_hf.cli.config import parse_with_config
from dflash_hf.cli.train import train
from dflash_hf.testing import tiny
from dflash_hf.training.decode_benchmark import decode_benchmark, prompt_inputs
from dflash_hf.training.launch import configure_cpu_threads, no_hf_progress_bars
from dflash_hf.training.training_args import DFlashDataArguments, DFlashTrainingArguments

DEMO_THREADS = 1
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "demo.yaml"


@dataclass
class DemoArguments:
    num_train_utterances: int = field(default=160, metadata={"help": "Synthetic training utterances."})
    num_dev_utterances: int = field(default=12, metadata={"help": "Held-out utterances (validation + decoding)."})
    target_hidden_size: int = field(default=64, metadata={"help": "Hidden size of the tiny target."})
    target_num_layers: int = field(default=6, metadata={"help": "Decoder layers of the tiny target."})
    decode_prompts: int = field(default=8, metadata={"help": "Held-out prompts decoded speculatively."})
    decode_max_new_tokens: int = field(default=48, metadata={"help": "New tokens per decoded prompt."})
    target_teach_steps: int = field(
        default=150, metadata={"help": "Steps teaching the tiny target to transcribe (0: leave it random)."}
    )
    target_teach_learning_rate: float = field(
        default=3e-3, metadata={"help": "AdamW learning rate of the tiny target's teaching steps."}
    )
    target_teach_max_tokens: int = field(
        default=3000, metadata={"help": "Token budget of one teaching batch (audio positions + text)."}
    )


def make_parser() -> HfArgumentParser:
    return HfArgumentParser((DemoArguments, DFlashTrainingArguments, DFlashDataArguments))


def teach_target(
    model, processor, manifest: Path, steps: int, prompt: str | None, lr: float = 3e-3, max_tokens: int = 3000
) -> float:
    """Teach the random tiny target to transcribe the synthetic speech (plain causal-LM loss on the
    response), so it behaves like a small ASR model with structured outputs. Returns the last loss."""
    from dflash_hf.data import ConversationConfig, build_train_dataloader

    loader = build_train_dataloader(
        str(manifest), processor, model.config, max_tokens=max_tokens, conversation=ConversationConfig(prompt=prompt)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(float("nan"))
    step, epoch = 0, 0
    with tqdm(total=steps, desc="teaching the tiny target") as bar:
        while step < steps:
            loader.set_epoch(epoch)
            for batch in loader:
                labels = torch.where(batch.pop("loss_mask"), batch["input_ids"], -100)
                loss = model(**batch, labels=labels).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")
                if step >= steps:
                    break
            epoch += 1
    model.eval()
    return float(loss.detach())


def build_assets(demo: DemoArguments, root: Path, prompt: str | None) -> tuple[Path, Path, Path, int]:
    """Tiny target directory, train and dev manifests, and the reserved mask token id."""
    tokenizer = tiny.build_tokenizer()
    model, processor = tiny.build_qwen3_asr_target(
        tokenizer, hidden_size=demo.target_hidden_size, num_layers=demo.target_num_layers, seed=0
    )
    train = tiny.synthesize_speech(root / "speech_train", demo.num_train_utterances, seed=0)
    dev = tiny.synthesize_speech(root / "speech_dev", demo.num_dev_utterances, seed=1)
    if demo.target_teach_steps:
        torch.manual_seed(0)
        teach_target(
            model,
            processor,
            train,
            demo.target_teach_steps,
            prompt,
            lr=demo.target_teach_learning_rate,
            max_tokens=demo.target_teach_max_tokens,
        )
    target_dir = root / "target"
    with no_hf_progress_bars():
        model.save_pretrained(target_dir)
    processor.save_pretrained(target_dir)
    return target_dir, train, dev, tokenizer.convert_tokens_to_ids(tiny.MASK_TOKEN)


def held_out_prompts(args, data_args, dev_manifest: Path, limit: int) -> list[dict]:
    """Prompt inputs (audio + instruction, no response) of the first held-out utterances."""
    from dflash_hf.cli.train import load_processor
    from dflash_hf.data import build_train_dataloader
    from dflash_hf.targets.frozen import load_target

    config = load_target(args.target_name_or_path).config
    loader = build_train_dataloader(
        str(dev_manifest),
        load_processor(args.target_name_or_path),
        config,
        max_tokens=data_args.max_tokens,
        max_batch_size=1,
        conversation=data_args.conversation(),
        shuffle=False,
    )
    prompts = []
    for batch in loader:
        p = prompt_inputs(batch)
        if p is not None:
            prompts.append(p)
        if len(prompts) >= limit:
            break
    return prompts


def run(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" not in argv:
        if not DEFAULT_CONFIG.is_file():
            raise FileNotFoundError(f"{DEFAULT_CONFIG} not found (not a repo checkout?): pass --config demo.yaml")
        argv = ["--config", str(DEFAULT_CONFIG), *argv]
    demo, args, data_args = parse_with_config(make_parser(), argv)
    root = Path(args.output_dir)
    target_dir, train_manifest, dev_manifest, mask_id = build_assets(demo, root / "assets", data_args.prompt)
    args.target_name_or_path = str(target_dir)
    args.mask_token_id = mask_id
    data_args.train_data = [str(train_manifest)]
    data_args.eval_data = [f"dev={dev_manifest}"]
    metrics = train(args, data_args)

    from dflash_hf.export.drafts import load_draft_strict
    from dflash_hf.targets.frozen import load_target

    draft = load_draft_strict(args.resolved_export_dir).eval()
    target = load_target(args.target_name_or_path)
    prompts = held_out_prompts(args, data_args, dev_manifest, demo.decode_prompts)
    stats = decode_benchmark(draft, target, prompts, demo.decode_max_new_tokens, progress=True, total=len(prompts))
    summary = {
        "export_dir": args.resolved_export_dir,
        "block_size": draft.config.block_size,
        "eval_dev_tau": metrics.get("eval_dev_tau"),
        "eval_dev_loss": metrics.get("eval_dev_loss"),
        "eval_dev_tau_est": metrics.get("eval_dev_tau_est"),
        **{f"decode_{k}": v for k, v in stats.as_dict().items()},
    }
    summary.update(
        target_dir=str(target_dir),
        train_manifest=str(train_manifest),
        dev_manifest=str(dev_manifest),
        mask_token_id=mask_id,
        prompt=data_args.prompt,
        num_draft_layers=draft.config.num_hidden_layers,
        max_steps=args.max_steps,
    )
    (root / "demo_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(summary_text(summary))
    return summary


def summary_text(summary: dict) -> str:
    """The demo's closing report: results, what the speed figures mean here, and the next step."""
    return "\n".join(
        [
            "",
            "=== dflash_hf demo ===",
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
            "  " + " \\\n      ".join(next_step_command(summary)),
        ]
    )


def validation_line(summary: dict) -> str:
    """The validation's real tau first (the estimate that predicts decoding), then the teacher-forced figures."""
    forced = f"loss {summary['eval_dev_loss']:.3f}, teacher-forced tau_est {summary['eval_dev_tau_est']:.2f}"
    if summary.get("eval_dev_tau") is None:
        return f"validation          {forced}"
    return f"validation          tau {summary['eval_dev_tau']:.2f} (real decoding of dev prompts; {forced})"


def next_step_command(summary: dict) -> list[str]:
    """`dflash-train` on the demo's target and manifests, as lines of flags (shell-quoted)."""
    q = shlex.quote
    return [
        f"dflash-train --target_name_or_path {q(summary['target_dir'])}",
        f"--train_data {q(summary['train_manifest'])} --eval_data {q('dev=' + summary['dev_manifest'])}",
        (f"--prompt {q(summary['prompt'])} " if summary["prompt"] else "")
        + f"--mask_token_id {summary['mask_token_id']}",
        f"--block_size {summary['block_size']} --num_draft_layers {summary['num_draft_layers']} "
        f"--max_steps {summary['max_steps']} --use_cpu true",
        "--attention_backend sdpa --output_dir runs/my-first-draft",
    ]


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
