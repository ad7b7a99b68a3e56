"""Bit-exact parity of the training objective across a refactor.

Runs a few training micro-batches through the Trainer's own hooks (`get_batch_samples` -> `training_step`, the
path `Trainer.train` takes), for DFlash and DFlash2, padded (both padding sides) and packed, fused and dense CE,
both label sources, on the tiny text target with fixed seeds. It records every micro-batch loss, the accumulated
gradients, the logged training metrics, the evaluation metrics and the draft exported after two optimizer
steps. Run it on two versions of the code and compare the files: every tensor must be `torch.equal`.

    PYTHONPATH=/tmp/before python scripts/check_objective_parity.py --save /tmp/before.pt
    PYTHONPATH=$PWD python scripts/check_objective_parity.py --save /tmp/after.pt --compare /tmp/before.pt

Only the Trainer's public hooks are used, so the script runs unchanged on code from before and after the
objective moved out of the trainer.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from utils import ListDataset, make_trainer, random_rows, text_batch, tiny_text_target  # noqa: E402

from dflash_hf.data.packing import pack_padded_batch  # noqa: E402

# name -> (DFlashTrainingArguments fields, padding side, packed)
CASES = {
    "dflash_right_argmax": (dict(label_source="target_argmax"), "right", False),
    "dflash_left_ground_truth": (dict(label_source="ground_truth"), "left", False),
    "dflash_left_dense_ce": (dict(label_source="target_argmax", use_fused_linear_ce=False), "left", False),
    "dflash2_left_argmax": (dict(variant="dflash2", label_source="target_argmax", selector_top_k=4), "left", False),
    "dflash_packed_argmax": (dict(label_source="target_argmax", packing=True, packing_max_tokens=4096), "right", True),
    "dflash2_packed_ground_truth": (
        dict(variant="dflash2", label_source="ground_truth", selector_top_k=4, packing=True, packing_max_tokens=4096),
        "right",
        True,
    ),
}


def _collator(tok, side: str, packed: bool):
    def collate(rows):
        batch = text_batch(rows, tok.pad_token_id, side)
        return pack_padded_batch(batch, pad_to_multiple_of=8, pad_token_id=tok.pad_token_id) if packed else batch

    return collate


def run_case(name: str, model, tok, tmp: Path) -> dict[str, torch.Tensor]:
    fields, side, packed = CASES[name]
    rows = random_rows(8, 250, seed=3)
    collate = _collator(tok, side, packed)
    common = dict(
        num_anchors=6,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        max_steps=2,
        **fields,
    )
    out: dict[str, torch.Tensor] = {}

    # one optimizer step by hand through the Trainer's hooks: losses and accumulated gradients
    trainer = make_trainer(tmp / name / "a", model, tok, rows, **common)
    trainer.data_collator = collate
    trainer.create_optimizer_and_scheduler(num_training_steps=2)
    batches = iter([collate(rows[i : i + 2]) for i in range(0, 8, 2)])
    samples, denom = trainer.get_batch_samples(batches, 2, trainer.args.device)
    out["denominator"] = torch.as_tensor(denom).detach().clone()
    for i, batch in enumerate(samples):
        out[f"micro{i}_loss"] = trainer.training_step(trainer.model, batch, denom).detach().clone()
    for pname, p in trainer.model.named_parameters():
        if p.grad is not None:
            out[f"grad/{pname}"] = p.grad.detach().clone()
    trainer.log({"loss": 0.0})
    for key, value in trainer.state.log_history[-1].items():
        if isinstance(value, (int, float)) and key != "step" and not key.endswith(WALL_CLOCK):
            out[f"train_log/{key}"] = torch.tensor(float(value), dtype=torch.float64)
    metrics = trainer.evaluate(eval_dataset=ListDataset(rows[:4]))
    for key, value in metrics.items():
        if not key.endswith(WALL_CLOCK):
            out[f"eval/{key}"] = torch.tensor(float(value), dtype=torch.float64)

    # two optimizer steps of Trainer.train, then the export
    trainer = make_trainer(tmp / name / "b", model, tok, rows, **common)
    trainer.data_collator = collate
    trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            for key, value in entry.items():
                if isinstance(value, float) and not key.endswith(WALL_CLOCK) and key != "epoch":
                    out[f"step{entry['step']}_log/{key}"] = torch.tensor(value, dtype=torch.float64)
    export = Path(trainer.export_draft(str(tmp / name / "export")))
    for key, value in load_file(export / "model.safetensors").items():
        out[f"export/{key}"] = value
    return out


WALL_CLOCK = ("runtime", "per_second", "_ms", "train_minutes")  # host timings (step_ms, ...): never compared


def compare(new: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (or exist on one side only), wall-clock timings left out."""
    new, ref = ({k: v for k, v in d.items() if not k.endswith(WALL_CLOCK)} for d in (new, ref))
    bad = sorted(set(new) ^ set(ref))
    bad += [k for k in sorted(set(new) & set(ref)) if not torch.equal(new[k], ref[k])]
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save", required=True, help="write the recorded tensors here (torch.save)")
    p.add_argument("--compare", default=None, help="a file written by an earlier run: every tensor must be equal")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = tiny_text_target(num_layers=4, hidden_size=32)
    record: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases:
            record.update({f"{name}/{k}": v for k, v in run_case(name, model, tok, Path(tmp)).items()})
            print(f"{name}: recorded", flush=True)
    torch.save(record, args.save)
    print(f"{len(record)} tensors -> {args.save}")
    if args.compare:
        ref = torch.load(args.compare)
        ref = {k: v for k, v in ref.items() if k.split("/", 1)[0] in args.cases}
        bad = compare(record, ref)
        print("BIT-IDENTICAL" if not bad else f"{len(bad)} differ: {bad[:20]}")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
