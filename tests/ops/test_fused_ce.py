"""The fused lm_head + CE of the block loss against plain autograd over full float64 logits."""

import pytest
import torch
import torch.nn.functional as F

from dflash_hf.objective.losses import fused_lm_head_ce


def _reference(hidden, weight, labels, weights):
    logits = F.linear(hidden.double(), weight.double())
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (weights.double() * ce).sum(), logits.argmax(-1)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_fused_matches_autograd_loss_argmax_and_gradient(chunk_size):
    g = torch.Generator().manual_seed(0)
    m, h, v = 37, 16, 50
    weight = torch.randn(v, h, generator=g) / h**0.5
    labels = torch.randint(0, v, (m,), generator=g)
    weights = torch.rand(m, generator=g)
    hidden = torch.randn(m, h, generator=g, dtype=torch.float64).float().requires_grad_(True)
    ref_hidden = hidden.detach().clone().requires_grad_(True)

    loss, pred = fused_lm_head_ce(hidden, weight, labels, weights, chunk_size)
    (loss * 3.0).backward()  # a non-unit upstream gradient must scale the stored one
    ref_loss, ref_pred = _reference(ref_hidden, weight, labels, weights)
    (ref_loss * 3.0).backward()

    assert loss.dtype == torch.float32 and not pred.requires_grad
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(pred, ref_pred)
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-5, atol=1e-6)
    assert weight.grad is None


def test_fused_without_grad_and_empty_rows():
    weight = torch.randn(11, 4)
    hidden = torch.randn(5, 4)
    loss, pred = fused_lm_head_ce(hidden, weight, torch.arange(5), torch.ones(5), chunk_size=2)
    ref_loss, ref_pred = _reference(hidden, weight, torch.arange(5), torch.ones(5))
    torch.testing.assert_close(loss.double(), ref_loss)
    assert torch.equal(pred, ref_pred)

    empty = torch.zeros(0, 4, requires_grad=True)
    loss, pred = fused_lm_head_ce(empty, weight, torch.zeros(0, dtype=torch.long), torch.zeros(0), chunk_size=2)
    loss.backward()
    assert float(loss.detach()) == 0.0 and pred.shape == (0,) and empty.grad.shape == (0, 4)
    with pytest.raises(ValueError, match="ce_chunk_size"):
        fused_lm_head_ce(hidden, weight, torch.arange(5), torch.ones(5), chunk_size=0)


def test_block_loss_fused_and_dense_chunk_paths_agree():
    """`use_fused_linear_ce` true (gradient made in the forward) and false (dense chunks recomputed in
    backward) give the same loss sum, correctness and gradient."""
    from dflash_hf.objective.blocks import build_blocks
    from dflash_hf.objective.losses import block_loss

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 50, (2, 24), generator=g)
    loss_mask = torch.zeros(2, 24, dtype=torch.bool)
    loss_mask[:, 8:] = True
    doc = torch.zeros(2, 24, dtype=torch.long)
    pos = torch.arange(24)[None].expand(2, -1)
    blocks = build_blocks(ids, ids, loss_mask, doc, pos, torch.tensor([[8, 12, 20], [9, 15, -1]]), 4, 1, 4.0)
    weight = torch.randn(50, 16, generator=g) / 4
    outs = []
    for fused in (True, False):
        hidden = torch.randn(2, 3, 4, 16, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
        out = block_loss(hidden, blocks, weight, chunk_size=5, fused=fused)
        out.loss_sum.backward()
        outs.append((out.loss_sum.detach(), out.correct, hidden.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    torch.testing.assert_close(outs[0][2], outs[1][2])
    assert outs[0][2].abs().sum() > 0
