"""`float8_lm_head`: the fused lm_head + CE with its input-gradient matmul in FP8. The loss and argmax equal the
exact kernel's to the bit; the gradient is the matmul of the dequantized operands (row scale `w(1 - p_label)/448`,
the lm_head per input feature, quantized once); every FP8 matmul meets the GPU operator's contract."""

import pytest
import torch
import torch.nn.functional as F
from utils import gpu_scaled_mm_contract

from dflash_hf.objective.losses import fused_lm_head_ce
from dflash_hf.ops.float8 import E4M3_MAX, frozen_weight_for_input_grad, quantize
from dflash_hf.ops.fused_ce import _ce_and_logit_grad


def _case(dtype, m=37, h=64, v=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    hidden = (torch.randn(m, h, generator=g) * 2).to(dtype)
    labels = torch.randint(0, v, (m,), generator=g)
    weights = torch.rand(m, generator=g) + 0.1
    return hidden, weight, labels, weights


def _run(hidden, weight, labels, weights, chunk, fp8):
    x = hidden.clone().requires_grad_()
    loss, pred = fused_lm_head_ce(x, weight, labels, weights, chunk, fp8=fp8)
    (loss * 2.0).backward()
    return loss.detach(), pred, x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [5, 64])
def test_fp8_gradient_is_the_dequantized_matmul_and_the_loss_is_exact(dtype, chunk):
    hidden, weight, labels, weights = _case(dtype)
    loss8, pred8, grad8 = _run(hidden, weight, labels, weights, chunk, fp8=True)
    loss, pred, grad = _run(hidden, weight, labels, weights, chunk, fp8=False)
    assert torch.equal(loss8, loss) and torch.equal(pred8, pred)  # the forward is untouched
    assert grad8.dtype == dtype and not torch.equal(grad8, grad)

    # reference: softmax - onehot scaled per row by its largest magnitude, both operands dequantized
    logits = (hidden @ weight.t()).float()
    delta = torch.softmax(logits, -1) - F.one_hot(labels, weight.shape[0])
    amax = delta.abs().amax(-1, keepdim=True)
    dq = (delta * (E4M3_MAX / amax)).to(torch.float8_e4m3fn).float() * (amax * weights[:, None] / E4M3_MAX)
    wq, w_scale = quantize(weight, 0)
    ref = 2.0 * dq @ (wq.float() * w_scale)
    tol = dict(rtol=2e-2, atol=2e-3) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad8.float(), ref, **tol)
    exact = 2.0 * (delta * weights[:, None]) @ weight.float()
    rel = (grad8.float() - exact).norm() / exact.norm()
    assert 1e-4 < rel < 0.08  # FP8 rounding, near the exact gradient


def test_row_scale_is_the_rows_largest_magnitude():
    """`1 - p_label` is each row's max |softmax - onehot|: the kernel's e4m3 rows reach 448 exactly as `quantize`'s
    would, without a pass to find the maximum (also for a row whose label is nearly certain)."""
    hidden, weight, labels, weights = _case(torch.float32)
    logits = hidden @ weight.t()
    logits[0, labels[0]] += 30.0  # p_label ~ 1
    _, _, q, scale = _ce_and_logit_grad(logits, labels, weights, need_grad=True, fp8=True)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (len(labels), 1)
    assert torch.equal(q.float().abs().amax(-1), torch.full((len(labels),), E4M3_MAX))
    # against float64 (in float32, p_label - 1 of row 0 cancels to 0; the kernel takes -(the rest of the mass))
    exact = (torch.softmax(logits.double(), -1) - F.one_hot(labels, logits.shape[1])) * weights[:, None]
    err = (q.double() * scale - exact).abs()  # e4m3: 3 mantissa bits; below the row's subnormals, rounded to zero
    assert bool((err <= exact.abs() * 2**-4 + scale * 2**-9).all())


def test_every_fp8_matmul_meets_the_gpu_operator_contract(monkeypatch):
    calls: list = []
    monkeypatch.setattr(torch, "_scaled_mm", gpu_scaled_mm_contract(calls))
    hidden, weight, labels, weights = _case(torch.bfloat16, m=37, h=64, v=400)
    _run(hidden, weight, labels, weights, 16, fp8=True)
    assert calls == [((16, 400), (400, 64)), ((16, 400), (400, 64)), ((5, 400), (400, 64))]  # one per chunk


def test_the_frozen_lm_head_is_quantized_once_until_it_changes():
    weight = torch.randn(1000, 32).to(torch.bfloat16)
    wq, scale = frozen_weight_for_input_grad(weight, rows=300)  # in row chunks: the same as one pass
    ref_q, ref_scale = quantize(weight, 0)
    assert torch.equal(wq.float(), ref_q.float()) and torch.equal(scale, ref_scale)
    assert wq.stride() == (1, 1000)  # column-major, as `_scaled_mm`'s second operand
    assert frozen_weight_for_input_grad(weight)[0] is wq
    weight.mul_(2.0)  # a frozen weight changed in place (a checkpoint loaded into the target): quantized again
    again, _ = frozen_weight_for_input_grad(weight)
    assert again is not wq and torch.equal(again.float(), quantize(weight, 0)[0].float())
    head = torch.nn.Linear(32, 1000, bias=False)
    first, _ = frozen_weight_for_input_grad(head.weight)
    head.to(torch.float64)  # the same Parameter, new storage, no in-place version bump
    assert frozen_weight_for_input_grad(head.weight)[0] is not first


def test_fp8_operands_are_checked_before_the_matmul():
    hidden, weight, labels, weights = _case(torch.float32, v=263)  # 263 words: not a multiple of 16
    with pytest.raises(ValueError, match=r"multiples of 16 .*got 263 x 64: set float8_lm_head=false"):
        _run(hidden, weight, labels, weights, 16, fp8=True)


@pytest.mark.slow  # 9 s on 2 busy cores (torch.compile)
def test_the_compiled_ce_kernel_writes_the_eager_e4m3_rows():
    """On a GPU the CE kernel runs compiled (`fused_ce._ce_grad`); its FP8 branch traces in one graph, also once the
    row count turns dynamic, and writes eager's e4m3 rows (CE and scales equal up to float32 rounding)."""
    compiled = torch.compile(_ce_and_logit_grad, fullgraph=True)
    for rows in (37, 53):
        hidden, weight, labels, weights = _case(torch.bfloat16, m=rows, seed=rows)
        logits = hidden @ weight.t()
        eager = _ce_and_logit_grad(logits, labels, weights, True, True)
        got = compiled(logits, labels, weights, True, True)
        assert torch.equal(got[1], eager[1])
        assert (got[2].float() != eager[2].float()).float().mean() < 1e-3  # a last-step flip at most, rarely
        torch.testing.assert_close(got[0], eager[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[3], eager[3], rtol=1e-5, atol=0)
