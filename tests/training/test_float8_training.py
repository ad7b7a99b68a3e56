"""`float8_draft_linears`: which layers a training draft converts, what it saves, and that a resumed FP8 run ends
bit-identical to an uninterrupted one (scales come from each step's own operands)."""

import pytest
import torch
from safetensors.torch import load_file
from utils import (
    assert_bitwise_equal,
    gpu_scaled_mm_contract,
    make_args,
    make_trainer,
    random_rows,
    tiny_text_target,
    trainer_weights,
)

from dflash_hf import DFlashTrainer
from dflash_hf.ops.float8 import Float8Linear, float8_draft_linears
from dflash_hf.testing import tiny

PROJECTIONS = [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
    f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")
]


def _trainer(root, model, tok, **kw) -> DFlashTrainer:
    base = dict(
        mask_token_id=tok.convert_tokens_to_ids(tiny.MASK_TOKEN),
        per_device_train_batch_size=2,
        max_steps=6,
        learning_rate=1e-3,
        logging_steps=1,
        float8_draft_linears=True,
    )
    return make_trainer(root, model, tok, random_rows(8, 250, seed=2), **(base | kw))


@pytest.mark.slow  # 6 s on 2 busy cores
def test_the_draft_trains_with_fp8_linears_and_saves_the_same_checkpoint(tmp_path):
    model, tok = tiny_text_target()
    fp8 = _trainer(tmp_path / "fp8", model, tok)
    converted = sorted(n for n, m in fp8.model.named_modules() if isinstance(m, Float8Linear))
    layers = len(fp8.model.layers)
    assert converted == sorted(["fc"] + [f"layers.{i}.{p}" for i in range(layers) for p in PROJECTIONS])
    plain = _trainer(tmp_path / "plain", model, tok, float8_draft_linears=False)
    assert_bitwise_equal(trainer_weights(fp8), trainer_weights(plain))  # the same initial draft (seed)
    fp8.train()
    plain.train()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (fp8, plain)]
    assert len(losses[0]) == len(losses[1]) == 6
    assert losses[0] != losses[1]  # FP8 rounding changes the numbers ...
    for a, b in zip(*losses):
        assert abs(a - b) <= 0.05 * b  # ... by little on this draft
    assert losses[0][-1] < losses[0][0]
    fp8.save_model(str(tmp_path / "saved"))
    plain.save_model(str(tmp_path / "saved_plain"))
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("saved", "saved_plain"))
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape for k in a)


def test_every_fp8_matmul_of_a_bf16_training_step_meets_the_gpu_operator_contract(tmp_path, monkeypatch):
    """The draft's own activations (attention output into o_proj, the taps into fc, ...) in bf16, as a GPU run trains,
    reach `_scaled_mm` in the layouts the CUDA operator accepts; fc's input (the frozen taps) has no gradient."""
    calls: list = []
    monkeypatch.setattr(torch, "_scaled_mm", gpu_scaled_mm_contract(calls))
    model, tok = tiny_text_target()
    trainer = _trainer(tmp_path, model, tok, max_steps=1, precision="bf16")
    trainer.train()
    layers = len(trainer.model.layers)
    assert len(calls) == 2 * len(PROJECTIONS) * layers + 1  # forward and input gradient of each; fc's forward


def test_a_resumed_fp8_run_ends_bit_identical(tmp_path):
    model, tok = tiny_text_target()
    straight = _trainer(tmp_path / "a", model, tok, save_strategy="steps", save_steps=3)
    straight.train()
    resumed = _trainer(tmp_path / "b", model, tok, save_strategy="steps", save_steps=3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-3"))
    assert_bitwise_equal(trainer_weights(straight), trainer_weights(resumed))


def test_a_draft_without_convertible_layers_is_refused_and_unaligned_ones_are_named(caplog):
    with pytest.raises(ValueError, match="found no draft linear layer .*: set float8_draft_linears=false"):
        float8_draft_linears(torch.nn.Sequential(torch.nn.Linear(16, 16)))
    draft = torch.nn.Module()
    draft.fc = torch.nn.Linear(64, 32, bias=False)
    draft.layers = torch.nn.ModuleList([torch.nn.Module()])
    draft.layers[0].mlp = torch.nn.Module()
    draft.layers[0].mlp.up_proj = torch.nn.Linear(32, 40, bias=False)  # 40: not a multiple of 16
    with caplog.at_level("WARNING", logger="dflash_hf.ops.float8"):
        assert float8_draft_linears(draft) == ["fc"]
    assert "layers.0.mlp.up_proj stay in the training precision" in caplog.text
    assert type(draft.layers[0].mlp.up_proj) is torch.nn.Linear


def _padded_vocab_target():
    """The tiny target with its vocabulary padded to a multiple of 16 (263 -> 272 rows, as real checkpoints pad)."""
    model, tok = tiny_text_target()
    model.resize_token_embeddings(272)
    return model, tok


def test_fp8_lm_head_keeps_the_first_loss_exact_and_resumes_bit_identical(tmp_path):
    """The forward (logits, loss) is untouched, so the first step's loss equals the plain run's to the bit; later ones
    move apart by the FP8 gradient's rounding, little; a resumed run ends bit-identical."""
    model, tok = _padded_vocab_target()
    kw = dict(float8_draft_linears=False, float8_lm_head=True, label_source="target_argmax")
    fp8 = _trainer(tmp_path / "fp8", model, tok, save_strategy="steps", save_steps=3, **kw)
    assert fp8.objective.settings.float8_lm_head and fp8.objective.settings.use_fused_linear_ce
    plain = _trainer(tmp_path / "plain", model, tok, **(kw | dict(float8_lm_head=False)))
    fp8.train()
    plain.train()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (fp8, plain)]
    assert losses[0][0] == losses[1][0] and losses[0] != losses[1]
    for a, b in zip(*losses):
        assert abs(a - b) <= 0.05 * b
    resumed = _trainer(tmp_path / "resumed", model, tok, **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "fp8" / "out" / "checkpoint-3"))
    assert_bitwise_equal(trainer_weights(fp8), trainer_weights(resumed))


def test_fp8_lm_head_is_refused_where_it_cannot_run(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"float8_lm_head=true runs in the fused lm_head \+ CE, which this run does "
        r"not use .*: set float8_lm_head=false",
    ):
        make_args(tmp_path, mask_token_id=262, float8_lm_head=True, variant="dflash2")
    with pytest.raises(ValueError, match="float8_lm_head=true runs in the fused"):
        make_args(tmp_path, mask_token_id=262, float8_lm_head=True, use_fused_linear_ce=False)
    model, tok = tiny_text_target()  # 263 words
    with pytest.raises(ValueError, match=r"multiples of 16 .*got 263 x 64: set float8_lm_head=false"):
        _trainer(tmp_path, model, tok, float8_draft_linears=False, float8_lm_head=True)
