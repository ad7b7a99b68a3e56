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
