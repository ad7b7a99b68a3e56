"""CUDA-only (marked `gpu`, skipped on CPU): a non-finite step on a GPU is read one step late (no host sync per step)
and still never reaches a checkpoint or an export (`dflash_hf.training.step_guards`)."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback
from utils import make_trainer, random_rows, tiny_text_target

from dflash_hf.training.step_guards import NonFiniteStepError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_non_finite_step_on_a_gpu_is_caught_before_the_next_step_and_never_saved(tmp_path):
    model, tok = tiny_text_target()

    class PoisonTargetAfterStep2(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                with torch.no_grad():
                    next(model.parameters()).fill_(float("nan"))

    trainer = make_trainer(
        tmp_path,
        model,
        tok,
        random_rows(8, 250, seed=3),
        max_steps=6,
        save_strategy="steps",
        save_steps=2,
        num_draft_layers=1,
        use_cpu=False,
    )
    trainer.add_callback(PoisonTargetAfterStep2())
    with pytest.raises(NonFiniteStepError, match=r"at optimizer step 3 .*reached the draft in memory"):
        trainer.train()
    assert trainer.state.global_step == 3  # stopped at step 4's check, before its optimizer step and save
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2"]


def test_the_finite_check_of_a_step_never_waits_for_the_device():
    """The guard's per-step work (stack, copy to pinned memory, event; the previous step's verdict read) makes no
    synchronizing call: CUDA's sync debug mode raises on any."""
    from dflash_hf.training.step_guards import FiniteStepGuard

    guard = FiniteStepGuard()
    weights = torch.randn(4096, device="cuda", requires_grad=True)
    for step in range(1, 4):  # warm up the pinned-memory cache
        loss = (weights * weights).sum()
        loss.backward()
        guard.add_loss(loss.detach())
        guard.observe(torch.linalg.vector_norm(weights.grad), step)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(4, 8):
            loss = (weights * weights).sum()
            loss.backward()
            guard.add_loss(loss.detach())
            guard.observe(torch.linalg.vector_norm(weights.grad), step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    guard.settle()
    weights.grad.fill_(float("inf"))
    guard.observe(torch.linalg.vector_norm(weights.grad), 8)
    with pytest.raises(NonFiniteStepError, match="non-finite gradient norm at optimizer step 8"):
        guard.settle()
