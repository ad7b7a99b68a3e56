"""FP8 draft linears (`dflash_hf.ops.float8`): scale orientation, the three matmuls against their dequantized
references,
eval mode exact, and the device check. The CPU runs the same `torch._scaled_mm` operator as the GPU."""

import pytest
import torch
import torch.nn.functional as F
from utils import gpu_scaled_mm_contract, make_args

from dflash_hf.ops.float8 import E4M3_MAX, Float8Linear, _Float8Linear, check_float8_device, quantize


def _dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


@pytest.mark.parametrize("dim", [-1, 0])
def test_quantize_maps_each_slice_amax_to_the_e4m3_maximum(dim):
    torch.manual_seed(0)
    x = torch.randn(24, 32) * torch.logspace(-3, 3, 32)  # columns of very different sizes
    q, scale = quantize(x, dim)
    assert q.dtype == torch.float8_e4m3fn
    assert scale.shape == ((24, 1) if dim == -1 else (1, 32))
    amax = q.float().abs().amax(dim=dim)
    assert amax.shape == (24 if dim == -1 else 32,)
    assert torch.equal(amax, torch.full_like(amax, E4M3_MAX))
    # e4m3 keeps 3 mantissa bits: every element within half a unit in the last place of its slice's scale
    err = (_dequantized(q, scale) - x).abs()
    assert bool((err <= x.abs() * 2**-4 + scale * 2**-9).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float8_matmuls_equal_their_dequantized_references(dtype):
    """Forward and input gradient are the matmuls of the per-row / per-feature dequantized operands (a transposed
    scale would be far off); the weight gradient is the exact one."""
    torch.manual_seed(1)
    x = torch.randn(37, 64, dtype=dtype, requires_grad=True)  # 37 rows: not a multiple of 16
    w = (torch.randn(48, 64) * 0.1).to(dtype).requires_grad_()
    y = _Float8Linear.apply(x, w)
    g = torch.randn_like(y)
    y.backward(g)
    assert y.dtype == x.grad.dtype == w.grad.dtype == dtype

    ref_y = _dequantized(*quantize(x.detach(), -1)) @ _dequantized(*quantize(w.detach(), -1)).t()
    ref_gx = _dequantized(*quantize(g, -1)) @ _dequantized(*quantize(w.detach(), 0))
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.detach().float(), ref_y, **tol)
    torch.testing.assert_close(x.grad.float(), ref_gx, **tol)
    torch.testing.assert_close(w.grad, (g.t().float() @ x.detach().float()).to(dtype), **tol)

    exact = x.detach().float() @ w.detach().float().t()
    rel = (y.detach().float() - exact).norm() / exact.norm()
    assert 1e-4 < rel < 0.08  # FP8 rounding, not an exact matmul


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "row_slice"])
def test_every_fp8_matmul_meets_the_gpu_operator_contract(monkeypatch, layout):
    """The CPU `_scaled_mm` accepts any layout and output dtype; the GPU's does not (`gpu_scaled_mm_contract`).
    A transposed input (a column-major view, which `reshape` keeps) is quantized row-major."""
    calls: list = []
    monkeypatch.setattr(torch, "_scaled_mm", gpu_scaled_mm_contract(calls))
    torch.manual_seed(3)
    x = {
        "contiguous": torch.randn(3, 7, 64),
        "transposed": torch.randn(64, 21).t(),  # (bf16 copies keep strides)
        "row_slice": torch.randn(21, 80).to(torch.bfloat16)[:, 8:72],
    }[layout].to(torch.bfloat16)
    assert x.is_contiguous() == (layout == "contiguous")
    x = x.detach().requires_grad_()
    layer = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    layer.__class__ = Float8Linear
    out = layer(x)
    out.backward(torch.randn_like(out))
    rows = x.numel() // 64
    assert calls == [((rows, 64), (64, 48)), ((rows, 48), (48, 64))]  # forward, input gradient
    assert x.grad.shape == x.shape and layer.weight.grad.shape == (48, 64)


def test_float8_linear_is_exact_in_eval_mode_and_fp8_in_training():
    torch.manual_seed(2)
    layer = torch.nn.Linear(32, 16, bias=False)
    layer.__class__ = Float8Linear
    x = torch.randn(2, 5, 32)
    assert layer.training  # a new module
    out = layer(x)
    assert out.shape == (2, 5, 16)
    assert not torch.equal(out, F.linear(x, layer.weight))
    torch.testing.assert_close(out, F.linear(x, layer.weight), rtol=0.1, atol=0.05)
    layer.eval()
    assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_device_check_names_the_field_and_the_fix(monkeypatch):
    check_float8_device(torch.device("cpu"))  # the same operators, for tests
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(
        ValueError,
        match=r"float8_draft_linears=true needs FP8 tensor cores .* 8\.0: set "
        r"float8_draft_linears=false",
    ):
        check_float8_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_device(torch.device("cuda"))
    with pytest.raises(ValueError, match="runs on CUDA"):
        check_float8_device(torch.device("mps"))


def test_training_arguments_refuse_fp8_with_lora_or_off_cuda(tmp_path, monkeypatch):
    args = make_args(tmp_path, mask_token_id=262, float8_draft_linears=True)
    args.lora_r = 4  # (LoRA itself needs an exported draft to adapt; the FP8 check alone here)
    with pytest.raises(ValueError, match=r"lora_r > 0 wraps .*: set float8_draft_linears=false or lora_r=0"):
        args._check_float8()
    args.lora_r = 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    args.use_cpu = False
    with pytest.raises(ValueError, match=r"not on mps: set float8_draft_linears=false"):
        args._check_float8()


@pytest.mark.parametrize(
    ("capability", "precision", "match"),
    [
        ((8, 0), "bf16", r"needs FP8 tensor cores"),
        ((9, 0), "fp32", r"float8_draft_linears=true on a GPU needs precision=bf16.*got precision='fp32'"),
    ],
)
def test_training_arguments_refuse_fp8_where_it_cannot_run(tmp_path, monkeypatch, capability, precision, match):
    args = make_args(tmp_path, mask_token_id=262, float8_draft_linears=True)  # on the CPU: accepted
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    args.use_cpu, args.precision = False, precision
    with pytest.raises(ValueError, match=match):
        args._check_float8()
    args.precision = "bf16"
    if capability >= (8, 9):
        args._check_float8()  # an FP8 GPU in bf16: accepted


@pytest.mark.slow  # 8 s on 2 busy cores
def test_compiled_float8_linear_equals_eager_as_the_row_count_changes():
    """`torch_compile_layers: [draft]` compiles the converted layers (`nn.Module.compile`): the autograd function and
    `_scaled_mm` trace in one graph, also once the token count turns dynamic, with eager's numbers."""
    torch.manual_seed(4)
    eager = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    eager.__class__ = Float8Linear
    compiled = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    compiled.__class__ = Float8Linear
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(fullgraph=True)
    for rows in (37, 53, 29):  # the second shape makes the row count symbolic
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        g = torch.randn(rows, 48, dtype=torch.bfloat16)
        results = []
        for layer in (eager, compiled):
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            out = layer(xi)
            out.backward(g)
            results.append((out.detach(), xi.grad, layer.weight.grad))
        for a, b in zip(*results):
            assert torch.equal(a, b)
