"""FP8 matmuls for the draft's linear layers while training (`float8_draft_linears`, opt-in).

A converted layer keeps its bf16/fp32 weight (the same `Parameter`: optimizer, state dict and checkpoint unchanged)
and, in training mode, computes two of its three matmuls in float8 e4m3 on the tensor cores (`torch._scaled_mm`):

- forward `y = x @ Wᵀ`: `x` scaled per row (one scale per token), `W` per output feature;
- input gradient `dx = dy @ W`: `dy` scaled per row, `W` per input feature;
- weight gradient `dW = dyᵀ @ x`: in the layer's own precision (the accuracy-sensitive one, kept exact).

Scales are computed from each operand's current absolute maximum (no history), so a step depends on nothing but
its inputs: resumed runs stay bit-identical. In eval mode (validation, speculative decoding) a layer is a plain
`nn.Linear`: the draft is evaluated and served as it is saved. The frozen lm_head (in the loss) stays in the
training precision. Needs FP8 tensor cores on a GPU (compute capability 8.9 or newer); the CPU runs the same
operators (slowly) for tests.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer
_ALIGN = 16  # torch._scaled_mm needs both dimensions of the weight to be multiples of 16
# the draft's decoder-layer projections and its context projection; DFlash2's small selector/kernel
# projections and any adapter stay in the training precision
CONVERTED = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[R, C]` in e4m3, scaled along `dim` (each slice's absolute maximum maps to 448), and the float32
    scale that multiplies the fp8 values back (`[R, 1]` for `dim=-1`, `[1, C]` for `dim=0`). The fp8 tensor is
    row-major whatever `x`'s strides (the GPU's `_scaled_mm` refuses a first operand that is not)."""
    x = x.detach()
    scale = _scale_for(x.abs().amax(dim=dim, keepdim=True))
    return _to_e4m3(x, scale), scale.reciprocal()


def _scale_for(amax: torch.Tensor) -> torch.Tensor:
    """The float32 factor that maps `amax` to e4m3's largest value."""
    return E4M3_MAX / amax.float().clamp(min=1e-12)


def _to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x * scale` in e4m3, row-major whatever `x`'s strides, through one float32 copy."""
    scaled = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    return scaled.mul_(scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _column_major(x: torch.Tensor) -> torch.Tensor:
    """The same `[R, C]` values laid out column by column (what `_scaled_mm`'s second operand needs)."""
    return x.t().contiguous().t()


# id(weight) -> (weak reference, what the weight's values were (`_state`), fp8 [V, H] column-major, scale [1, H]);
# an entry leaves with its weight
_FROZEN: dict[int, tuple] = {}


def _state(weight: torch.Tensor) -> tuple:
    """What identifies a weight's current values: its storage, dtype, device, shape and in-place version (`.to()`
    of its module swaps the storage; writes through `.data` are not seen)."""
    return weight.data_ptr(), weight.dtype, weight.device, tuple(weight.shape), weight._version


def frozen_weight_for_input_grad(weight: torch.Tensor, rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """A frozen `[V, H]` weight (the lm_head) as the second operand of `dx = dy @ W` in e4m3: column-major, one
    scale per input feature `[1, H]` (as :func:`quantize` with `dim=0`). Made once per weight and kept (V x H bytes)
    until the weight changes (in place, or moved or cast with its module); quantized `rows` rows at a time, so it
    never holds a float32 copy."""
    cached = _FROZEN.get(id(weight))
    if cached is not None and cached[0]() is weight and cached[1] == _state(weight):
        return cached[2], cached[3]
    w = weight.detach()
    scale = _scale_for(torch.stack([w[i : i + rows].abs().amax(0) for i in range(0, w.shape[0], rows)]).amax(0))
    wq_t = torch.empty(w.shape[1], w.shape[0], dtype=E4M3, device=w.device)  # [H, V]: W column-major
    for i in range(0, w.shape[0], rows):
        wq_t[:, i : i + rows] = _to_e4m3(w[i : i + rows], scale).t()
    key, quantized = id(weight), (wq_t.t(), scale[None, :].reciprocal())  # [V, H], [1, H]
    _FROZEN[key] = (weakref.ref(weight, lambda _, key=key: _FROZEN.pop(key, None)), _state(weight), *quantized)
    return quantized


Operand = tuple[torch.Tensor, torch.Tensor]  # (e4m3 values, float32 scale) of one `_scaled_mm` operand


def forward_operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[Operand, Operand]:
    """`y = x @ Wᵀ`'s operands (x `[M, K]`, weight `[N, K]`): `x` per row `[M, 1]`, `Wᵀ` per output feature `[1, N]`."""
    xq, x_scale = quantize(x, -1)  # [M, K], [M, 1]
    wq, w_scale = quantize(weight, -1)  # [N, K], [N, 1]
    return (xq, x_scale), (wq.t(), w_scale.t())


def input_grad_operands(grad: torch.Tensor, weight: torch.Tensor) -> tuple[Operand, Operand]:
    """`dx = dy @ W`'s operands (dy `[M, N]`, weight `[N, K]`): `dy` per row `[M, 1]`, `W` column-major per input
    feature `[1, K]`."""
    gq, g_scale = quantize(grad, -1)  # [M, N], [M, 1]
    wq, w_scale = quantize(weight, 0)  # [N, K], [1, K]
    return (gq, g_scale), (_column_major(wq), w_scale)


def scaled_mm(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b` on the FP8 tensor cores, dequantized by the operands' scales, in `out_dtype`."""
    return torch._scaled_mm(a[0], b[0], scale_a=a[1], scale_b=b[1], out_dtype=out_dtype)


class _Float8Linear(torch.autograd.Function):
    """`x @ Wᵀ` with the forward and input-gradient matmuls in e4m3 and the weight gradient in `x`'s dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # x [M, K], weight [N, K]
        ctx.save_for_backward(x, weight)
        return scaled_mm(*forward_operands(x, weight), x.dtype)  # [M, N]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # grad [M, N]
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_mm(*input_grad_operands(grad, weight), x.dtype)  # [M, K]
        if ctx.needs_input_grad[1]:
            grad_w = (grad.t() @ x).to(weight.dtype)  # [N, K]
        return grad_x, grad_w


class Float8Linear(nn.Linear):
    """`nn.Linear` (no bias) whose training-mode matmuls run in FP8 (module docstring); eval mode is exact."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.linear(x, self.weight)
        out = _Float8Linear.apply(x.reshape(-1, x.shape[-1]), self.weight)
        return out.view(*x.shape[:-1], out.shape[-1])


def _candidate(name: str, module: nn.Module) -> bool:
    """A decoder-layer projection or `fc` of the draft, a plain `nn.Linear` without bias."""
    if type(module) is not nn.Linear or module.bias is not None:
        return False
    return name == "fc" or (name.startswith("layers.") and name.endswith(CONVERTED))


def _aligned(module: nn.Linear) -> bool:
    return module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0


def options_set(fields: tuple[str, ...], value: str) -> str:
    """`a=value and b=value`: the FP8 options named in an error message."""
    return " and ".join(f"{name}={value}" for name in fields)


def check_lm_head_shape(vocab: int, hidden: int) -> None:
    """Refuse `float8_lm_head` for an lm_head `_scaled_mm` cannot take (both dimensions multiples of 16)."""
    if vocab % _ALIGN or hidden % _ALIGN:
        raise ValueError(
            f"float8_lm_head=true needs the lm_head's vocabulary and hidden size to be multiples of "
            f"{_ALIGN} (FP8 tensor-core matmuls), got {vocab} x {hidden}: set float8_lm_head=false"
        )


def check_float8_device(device: torch.device, fields: tuple[str, ...] = ("float8_draft_linears",)) -> None:
    """Refuse a device without FP8 tensor cores (a GPU below compute capability 8.9: the options would run slower, not
    faster) or without the operators (anything but CUDA and the CPU). `fields`: the options asking for FP8."""
    on, off = options_set(fields, "true"), options_set(fields, "false")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            raise ValueError(
                f"{on} needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper or newer); "
                f"this GPU has {capability[0]}.{capability[1]}: set {off}"
            )
    elif device.type != "cpu":
        raise ValueError(f"{on} runs on CUDA (or the CPU, for tests), not on {device.type}: set {off}")


def float8_draft_linears(draft: nn.Module) -> list[str]:
    """Turn the draft's decoder-layer projections and `fc` (plain `nn.Linear` without bias, both dimensions multiples
    of 16) into :class:`Float8Linear` in place, keeping their weight `Parameter`s: call it before the layers are
    compiled; an optimizer built before keeps working. Returns the converted names; raises if there is none."""
    candidates = [(name, module) for name, module in draft.named_modules() if _candidate(name, module)]
    names = [name for name, module in candidates if _aligned(module)]
    if not names:
        raise ValueError(
            "float8_draft_linears=true found no draft linear layer to convert (decoder projections and "
            "fc without bias, dimensions multiples of 16): set float8_draft_linears=false"
        )
    skipped = [name for name, module in candidates if not _aligned(module)]
    if skipped:
        logger.warning(
            "float8_draft_linears: %s stay in the training precision (a dimension is not a multiple of %d)",
            ", ".join(skipped),
            _ALIGN,
        )
    for name in names:
        module = draft.get_submodule(name)
        module.__class__ = Float8Linear  # the same object: its weight, hooks and state-dict keys stay
    return names
