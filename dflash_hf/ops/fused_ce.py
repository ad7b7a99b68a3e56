"""Fused frozen-`lm_head` + cross-entropy: `Σ w·CE(hidden @ Wᵀ, labels)` chunk-wise with the input gradient made in
the forward pass, so a chunk's `[m, vocab]` logits are built once and never kept. Used by the `ce` loss with hard
labels (`--use_fused_linear_ce`, the DFlash default): its slot weights must be known before the forward.

`fp8` (`--float8_lm_head`, experimental): the input-gradient matmul `dlogits @ W` runs in float8 e4m3 on the tensor
cores. A row of `softmax - onehot` has its largest magnitude at the label, `1 - p_label` (every other probability is
at most the rest of the mass), so the CE kernel writes the row already scaled to e4m3's range (the rest of the mass
is a second log-sum-exp over the row it reads anyway) and `w·(1 - p_label)/448` is the row's scale; `W` is quantized
once (`float8.frozen_weight_for_input_grad`). The logits, loss and argmax are the ones without it (up to float32
rounding where the kernel is compiled: the FP8 branch is another graph)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_hf.ops.float8 import E4M3, E4M3_MAX, check_lm_head_shape, frozen_weight_for_input_grad, scaled_mm


def _ce_and_logit_grad(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, need_grad: bool, fp8: bool = False
):
    """Per-row CE and argmax of one chunk of logits (float32 math), and `d(Σ w·CE)/d logits` when asked: in the
    logits' dtype, or (`fp8`) as e4m3 values with their float32 row scales `[m, 1]`."""
    dtype = logits.dtype
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    ce = lse - logits.gather(1, labels[:, None]).squeeze(1)
    pred = logits.argmax(-1)
    if not need_grad:
        return ce, pred, None, None
    # softmax - onehot as one pointwise expression (an in-place scatter of -1 would make the compiled kernel
    # materialize the float32 softmax of the whole chunk before it)
    onehot = torch.arange(logits.shape[-1], device=logits.device)[None, :] == labels[:, None]
    probs = torch.exp(logits - lse[:, None])
    if not fp8:
        return ce, pred, ((probs - onehot.float()) * weights[:, None]).to(dtype), None
    # 1 - p_label as the other words' mass (no cancellation when p_label is near 1): the row's largest |delta|
    rest = torch.exp(torch.logsumexp(logits.masked_fill(onehot, float("-inf")), dim=-1) - lse)
    amax = rest.clamp(min=1e-30)[:, None]
    delta = torch.where(onehot, -amax, probs)
    quantized = (delta * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return ce, pred, quantized, amax * weights[:, None] / E4M3_MAX


_compiled_ce_grad = None


def _ce_grad(logits, labels, weights, need_grad, fp8):
    """`_ce_and_logit_grad`, compiled on accelerators (one fused pass over each chunk's logits)."""
    global _compiled_ce_grad
    if logits.device.type == "cpu":
        return _ce_and_logit_grad(logits, labels, weights, need_grad, fp8)
    if _compiled_ce_grad is None:
        # default dynamism: the row count becomes symbolic once chunks of two sizes were seen; the
        # vocabulary stays static, so the reduction over it is specialized
        _compiled_ce_grad = torch.compile(_ce_and_logit_grad)
    return _compiled_ce_grad(logits, labels, weights, need_grad, fp8)


def _check_fp8_operands(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """What `_scaled_mm` needs of the FP8 gradient's operands (on the host: no synchronization)."""
    check_lm_head_shape(*weight.shape)
    if hidden.is_cuda and hidden.dtype != torch.bfloat16:
        raise ValueError(f"float8_lm_head=true on a GPU needs bf16 draft states (precision=bf16), got {hidden.dtype}")


class _LinearCrossEntropy(torch.autograd.Function):
    """`Σ w·CE(hidden @ Wᵀ, labels)` chunk-wise, with `d/d hidden` computed in the forward pass: each chunk's
    logits are made once (checkpointed chunks would make them twice) and never outlive their chunk; backward
    only scales the stored `[M, H]` gradient. W (the frozen lm_head) gets no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_size, fp8):
        need_grad = ctx.needs_input_grad[0]
        loss = hidden.new_zeros((), dtype=torch.float32)
        pred = torch.empty_like(labels)
        grad = torch.empty_like(hidden) if need_grad else None
        if need_grad and fp8:
            _check_fp8_operands(hidden, weight)
            weight_fp8 = frozen_weight_for_input_grad(weight)  # [V, H] column-major, [1, H]
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = F.linear(hidden[rows], weight)
            ce, pred[rows], g, g_scale = _ce_grad(logits, labels[rows], weights[rows], need_grad, fp8)
            loss = loss + (weights[rows] * ce).sum()
            if need_grad and fp8:
                grad[rows] = scaled_mm((g, g_scale), weight_fp8, hidden.dtype)
            elif need_grad:
                grad[rows] = g @ weight
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(pred)
        return loss, pred

    @staticmethod
    def backward(ctx, grad_loss, grad_pred):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None


def fused_lm_head_ce(
    hidden: torch.Tensor,  # [M, H]
    lm_head_weight: torch.Tensor,  # [V, H] frozen
    labels: torch.Tensor,  # [M]
    weights: torch.Tensor,  # [M] slot weights (no grad)
    chunk_size: int = 1024,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(Σ w·CE, argmax)` of `lm_head(hidden)`, `chunk_size` rows of `[M, V]` logits at a time; `fp8`: the input
    gradient's matmul in FP8 (module docstring)."""
    if chunk_size <= 0:
        raise ValueError(f"ce_chunk_size must be > 0, got {chunk_size}")
    return _LinearCrossEntropy.apply(hidden, lm_head_weight, labels, weights.float(), chunk_size, fp8)
