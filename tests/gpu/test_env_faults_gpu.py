"""CUDA-only (marked `gpu`, skipped on CPU): a real CUDA out-of-memory error in a training step, raised by the caching
allocator for a micro-batch whose forward asks for more than the device has (`dflash_hf.training.env_faults`)."""

from __future__ import annotations

import pytest
import torch
from utils import make_trainer, random_rows, tiny_text_target

from dflash_hf import DFlashTrainer
from dflash_hf.errors import EnvironmentFault

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def too_big_at(monkeypatch, step: int) -> None:
    """The forward of optimizer step `step` also asks the allocator for twice the device's memory (a real CUDA OOM)."""
    real = DFlashTrainer.compute_loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        out = real(self, model, inputs, *args, **kwargs)
        if model.training and self.state.global_step + 1 == step:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        return out

    monkeypatch.setattr(DFlashTrainer, "compute_loss", compute_loss)


def _trainer(tmp_path, **kw) -> DFlashTrainer:
    model, tok = tiny_text_target()
    base = dict(per_device_train_batch_size=2, max_steps=4, num_draft_layers=1, use_cpu=False, logging_steps=1)
    return make_trainer(tmp_path, model, tok, random_rows(8, 250, seed=3), **(base | kw))


def test_a_cuda_out_of_memory_step_is_skipped_and_the_memory_recovered(tmp_path, monkeypatch):
    too_big_at(monkeypatch, 2)
    trainer = _trainer(tmp_path, skip_oom_batches=1)
    trainer.train()
    assert trainer.state.global_step == 4
    assert [s["step"] for s in trainer.step_faults.skipped] == [2]
    assert "Tried to allocate" not in trainer.step_faults.skipped[0]["micro_batch"]  # the shape, not torch's text
    logged = [h["skipped_oom_batches"] for h in trainer.state.log_history if "skipped_oom_batches" in h]
    assert logged == [0, 1, 1, 1]
    assert torch.cuda.memory_allocated() < torch.cuda.get_device_properties(0).total_memory // 4


def test_a_cuda_out_of_memory_step_stops_with_its_shape_and_a_checkpoint(tmp_path, monkeypatch):
    too_big_at(monkeypatch, 3)
    trainer = _trainer(tmp_path)
    with pytest.raises(EnvironmentFault, match=r"out of memory in optimizer step 3, micro-batch 1 of 1: 2 rows") as e:
        trainer.train()
    assert "Tried to allocate" in str(e.value) and "--skip_oom_batches N" in str(e.value)
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert e.value.saved and e.value.checkpoint == str(checkpoint)  # saved at the boundary before step 3
    assert (checkpoint / "dflash_checkpoint_complete.json").is_file()
