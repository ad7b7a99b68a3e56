"""A tiny text target and DFlash / DFlash2 drafts trained on its own greedy outputs, for serving-parity runs anywhere.

Builds a random Qwen3 text target with the package's byte-level tokenizer (head_dim 64, so every vLLM attention
backend takes it), has it write greedy continuations of short word prompts, trains a DFlash and a DFlash2 draft on
them (`label_source=target_argmax`, CPU, a few minutes) and writes, under `--out`:

- `target/` (model and tokenizer), `draft_dflash/` and `draft_dflash2/` (exports);
- `prompts.jsonl`: held-out requests as `{"text": ...}` (used verbatim: the target has no chat template).

    python benchmarks/tiny_serving_assets.py --out runs/tiny-serving
    python benchmarks/vllm_parity.py --target runs/tiny-serving/target --draft runs/tiny-serving/draft_dflash \\
        --prompts runs/tiny-serving/prompts.jsonl --max_new_tokens 48 --out serving_tiny_dflash.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from torch.utils.data import Dataset

from dflash_hf import DFlashTrainer, DFlashTrainingArguments
from dflash_hf.testing import tiny

WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "home", "with", "blue", "sky")
TARGET_SHAPE = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, seed=1)


class Rows(Dataset):
    """(prompt ids, response ids) pairs, `repeat` times over."""

    def __init__(self, rows: list[tuple[list[int], list[int]]], repeat: int):
        self.rows, self.repeat = rows, repeat

    def __len__(self) -> int:
        return len(self.rows) * self.repeat

    def __getitem__(self, i: int):
        return self.rows[i % len(self.rows)]


def collate(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch whose responses are supervised."""
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    supervised = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = 1
        supervised[i, len(p) : len(p) + len(r)] = True
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": supervised}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for the target, the drafts and the prompts.")
    parser.add_argument("--steps", type=int, default=400, help="Optimizer steps per draft.")
    parser.add_argument("--new_tokens", type=int, default=48, help="Greedy tokens the target writes per prompt.")
    parser.add_argument("--train_prompts", type=int, default=200, help="Prompts the drafts train on.")
    parser.add_argument("--eval_prompts", type=int, default=40, help="Held-out requests written to prompts.jsonl.")
    args = parser.parse_args(argv)

    tokenizer = tiny.build_tokenizer()
    model = tiny.build_text_target(tokenizer, **TARGET_SHAPE)
    tiny.save_tiny_target(args.out / "target", kind="text", tokenizer=tokenizer, **TARGET_SHAPE)
    rng = random.Random(0)
    texts = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
        for _ in range(args.train_prompts + args.eval_prompts)
    ]
    rows = []
    with torch.no_grad():
        for text in texts[: args.train_prompts]:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=args.new_tokens,
                do_sample=False,
            )
            rows.append((ids, out[0, len(ids) :].tolist()))
    with open(args.out / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[args.train_prompts :])

    mask_id = tokenizer.convert_tokens_to_ids(tiny.MASK_TOKEN)
    for variant in ("dflash", "dflash2"):
        train_args = DFlashTrainingArguments(
            output_dir=str(args.out / f"run_{variant}"),
            variant=variant,
            block_size=8,
            num_draft_layers=1,
            mask_token_id=mask_id,
            label_source="target_argmax",
            num_anchors=32,
            per_device_train_batch_size=8,
            learning_rate=1e-3,
            max_steps=args.steps,
            save_strategy="no",
            use_cpu=True,
            report_to="none",
            attention_backend="sdpa",
            disable_tqdm=True,
            seed=0,
        )
        trainer = DFlashTrainer(
            args=train_args,
            target=model,
            train_dataset=Rows(rows, 4),
            data_collator=lambda batch: collate(batch, tokenizer.pad_token_id),
        )
        trainer.train()
        trainer.export_draft(str(args.out / f"draft_{variant}"))
    print(f"target, drafts and prompts written to {args.out}")


if __name__ == "__main__":
    main()
