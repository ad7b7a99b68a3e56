"""Helper of tests/training/test_distributed.py: train a tiny draft a few steps on a fixed global batch and save the
logged losses and final draft weights.

Launched as `torchrun --nproc_per_node 2 tests/dist_train.py OUT_DIR CASE...` (CPU, gloo) or run in-process
through `train_case` for the single-process reference. A case is `name:per_device_batch:grad_accum:rows[:auto]`,
`rows` = `all` (the 4 supervised rows) or `half_empty` (2 rows, the second with no supervised token, so
with one row per rank one rank has no valid anchor in every step); `auto` leaves `use_cpu` unset (a plain
torchrun launch on a machine without CUDA). Case `fsdp_target` (distributed only) checks the FSDP2-sharded
frozen target against an unsharded copy, `fsdp_encoder_draft` an FSDP2-sharded encoder-context draft, `budget` the
`max_train_minutes` verdict of ranks that disagree (rank 0 over its budget from the first step, rank 1 never),
`row_preflight` the data pre-flight once per process group.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from utils import end_ranks, random_rows, text_batch, tiny_text_target  # noqa: E402

from dflash_hf import DFlashTrainer, DFlashTrainingArguments  # noqa: E402
from dflash_hf.testing.tiny import MASK_TOKEN  # noqa: E402

MAX_STEPS = 3
NUM_ANCHORS = 64  # more than any row's valid anchors: every valid anchor is taken, whatever the split


def dataset(rows: str, vocab: int) -> list[dict]:
    pairs = random_rows(4, vocab, seed=3)
    if rows == "half_empty":
        pairs = [pairs[0], (pairs[1][0] + pairs[1][1], [])]  # second row: all prompt, nothing supervised
    return [{"prompt": p, "response": r} for p, r in pairs]


def train_case(
    out_dir: str, name: str, per_device_batch: int, grad_accum: int, rows: str, use_cpu: bool = True
) -> dict:
    target, tok = tiny_text_target(num_layers=4, hidden_size=64)
    torch.manual_seed(0)  # same fresh draft in every process and every run

    def collate(examples):
        return text_batch([(e["prompt"], e["response"]) for e in examples], tok.pad_token_id)

    with tempfile.TemporaryDirectory() as tmp:
        args = DFlashTrainingArguments(
            output_dir=tmp,
            use_cpu=use_cpu,
            max_steps=MAX_STEPS,
            per_device_train_batch_size=per_device_batch,
            gradient_accumulation_steps=grad_accum,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
            mask_token_id=tok.convert_tokens_to_ids(MASK_TOKEN),
            num_draft_layers=2,
            target_layer_ids=[1, 2],
            num_anchors=NUM_ANCHORS,
            label_source="ground_truth",
            attention_backend="sdpa",
            dataloader_drop_last=True,
        )
        trainer = DFlashTrainer(args=args, target=target, train_dataset=dataset(rows, 256), data_collator=collate)
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    result = {
        "losses": [h["loss"] for h in logs],
        "skipped_steps": [h.get("skipped_steps", 0.0) for h in logs],
        "weights": {k: v.clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()},
    }
    if trainer.args.process_index == 0:
        torch.save(result, Path(out_dir) / f"{name}.pt")
    return result


def check_sharded_target(out_dir: str) -> None:
    """Taps and final hidden of an FSDP2-sharded frozen target equal those of an unsharded copy."""
    from dflash_hf.targets.frozen import FrozenTarget
    from dflash_hf.training.distributed import shard_frozen_target_layers

    model, tok = tiny_text_target(num_layers=4, hidden_size=64)
    reference = FrozenTarget(copy.deepcopy(model))
    sharded = FrozenTarget(model)
    count = shard_frozen_target_layers(sharded)
    rank = torch.distributed.get_rank()
    batch = text_batch(random_rows(2, 256, seed=10 + rank), tok.pad_token_id)  # different data per rank
    ref, got = (t.capture(batch, [1, 3], keep_final=True) for t in (reference, sharded))
    weight = sharded.layers[0].mlp.up_proj.weight
    result = {
        "sharded_layers": count,
        "taps_max_abs": float((ref.taps - got.taps).abs().max()),
        "final_max_abs": float((ref.final_hidden - got.final_hidden).abs().max()),
        "local_rows": weight.to_local().shape[0],
        "full_rows": weight.shape[0],
    }
    torch.save(result, Path(out_dir) / f"fsdp_target_rank{rank}.pt")


def check_sharded_encoder_context_draft(out_dir: str) -> None:
    """An encoder-context draft sharded layer by layer (FSDP2, as examples/accelerate/fsdp2.yaml wraps it) gives the
    unsharded draft's hidden states and gradients: the frames' keys/values are computed inside each layer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3Config

    from dflash_hf import DFlashConfig, DFlashDraftModel

    text = Qwen3Config(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        num_hidden_layers=4,
        vocab_size=100,
    )
    cfg = DFlashConfig.from_target_config(
        text, mask_token_id=5, num_hidden_layers=2, block_size=4, target_layer_ids=[0, 1], encoder_hidden_size=24
    )
    torch.manual_seed(0)
    reference = DFlashDraftModel(cfg)
    sharded = copy.deepcopy(reference)
    for layer in sharded.layers:
        fully_shard(layer, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    fully_shard(sharded, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        position_ids=torch.arange(9)[None],
        noise_embedding=torch.randn(1, 4, 32, generator=g),
        target_hidden=torch.randn(1, 5, 64, generator=g),
        encoder_hidden_states=torch.randn(1, 7, 24, generator=g),
    )
    ref, got = reference(**inputs), sharded(**inputs)
    ref.square().sum().backward()
    got.square().sum().backward()
    grad = sharded.layers[0].encoder_attn.k_proj.weight.grad.full_tensor()
    result = {
        "hidden_max_abs": float((ref - got).abs().max()),
        "k_grad_max_abs": float((reference.layers[0].encoder_attn.k_proj.weight.grad - grad).abs().max()),
    }
    torch.save(result, Path(out_dir) / f"fsdp_encoder_draft_rank{torch.distributed.get_rank()}.pt")


def check_time_budget_agreement(out_dir: str, steps: int = 4) -> None:
    """Rank 0 crosses its budget at the first step, rank 1 never: both must stop at the same step, the second (the
    ranks' verdict is read one step late)."""
    from types import SimpleNamespace

    from transformers import TrainerControl

    from dflash_hf.training.callbacks import TimeBudgetCallback

    if not torch.distributed.is_initialized():  # the case run alone, before any trainer started the group
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    budget = TimeBudgetCallback(1e-12 if rank == 0 else 1e9)
    args = SimpleNamespace(device=torch.device("cpu"), save_strategy="steps")
    control = TrainerControl()
    budget.on_train_begin(args, None, control)
    stopped = []
    for step in range(1, steps + 1):
        budget.on_step_end(args, SimpleNamespace(global_step=step, max_steps=steps), control)
        stopped.append(control.should_training_stop)
    torch.save({"stopped": stopped, "save": control.should_save}, Path(out_dir) / f"budget_rank{rank}.pt")


def check_rows_read_once(out_dir: str) -> None:
    """The data pre-flight of `dflash-train` (`training.row_preflight`): rank 0 reads a manifest's rows (one of them
    bad), rank 1 reads none and reuses rank 0's result when its loader opens the manifest; both count the bad row."""
    from dflash_hf.data import BadSamples, open_source, row_scan
    from dflash_hf.training.row_preflight import check_data_rows, share_data_rows
    from dflash_hf.training.training_args import DFlashDataArguments

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    manifest = Path(out_dir) / "preflight.jsonl"
    if rank == 0:
        rows = [{"audio_filepath": f"a{i}.wav", "duration": 1.0, "text": f"row {i}"} for i in range(6)]
        rows[3]["duration"] = -1.0
        manifest.write_text("".join(f"{json.dumps(r)}\n" for r in rows))
    torch.distributed.barrier()
    scans, real = [], row_scan.scan_rows
    row_scan.scan_rows = lambda *a, **k: scans.append(rank) or real(*a, **k)
    data_args = DFlashDataArguments(train_data=[str(manifest)], skip_bad_samples=True)
    if rank == 0:  # as `dflash-train` does before the target loads
        check_data_rows(data_args)
    share_data_rows(world, rank)  # after the target loaded
    bad = BadSamples(skip=True)
    open_source(data_args.train_sources()[0], bad)  # the trainer's loader
    torch.save({"scans": len(scans), "skipped": bad.num_skipped}, Path(out_dir) / f"preflight_rank{rank}.pt")


def main(argv: list[str]) -> None:
    out_dir, cases = argv[0], argv[1:]
    for case in cases:
        if case == "fsdp_target":
            check_sharded_target(out_dir)
            continue
        if case == "fsdp_encoder_draft":
            check_sharded_encoder_context_draft(out_dir)
            continue
        if case == "budget":
            check_time_budget_agreement(out_dir)
            continue
        if case == "row_preflight":
            check_rows_read_once(out_dir)
            continue
        name, batch, accum, rows, *device = case.split(":")
        train_case(out_dir, name, int(batch), int(accum), rows, use_cpu=device != ["auto"])


if __name__ == "__main__":
    main(sys.argv[1:])
    end_ranks()
