"""benchmarks/float8_linears.py: the draft projections of a shape, and its three variants computing what
training computes (the timings themselves are the GPU's business, not a test's)."""

import sys

import pytest
import torch
from utils import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import float8_linears as bench  # noqa: E402


def test_projections_follow_the_shape_and_the_draft():
    rows = {r["name"]: r for r in bench.projections(bench.SHAPES["qwen3-8b"], draft_layers=5, block_size=16)}
    q_rows, s_rows = 512 * 16, 3072
    assert (rows["q_proj"]["rows"], rows["q_proj"]["in_features"], rows["q_proj"]["out_features"]) == (
        q_rows,
        4096,
        4096,
    )
    assert (rows["k_proj"]["rows"], rows["k_proj"]["out_features"]) == (s_rows + q_rows, 8 * 128)
    assert (rows["down_proj"]["in_features"], rows["down_proj"]["out_features"]) == (12288, 4096)
    assert rows["fc"] == dict(
        name="fc", rows=s_rows, in_features=5 * 4096, out_features=4096, input_grad=False, count=1
    )
    assert {r["count"] for n, r in rows.items() if n != "fc"} == {5}
    speech = {r["name"]: r for r in bench.projections(bench.SHAPES["qwen3-1.7b-speechlike"], 5, 16)}
    assert speech["q_proj"]["rows"] == 64 * 40 * 16 and speech["fc"]["rows"] == 64 * 256
    with pytest.raises(SystemExit, match="--shape"):
        bench.projections(bench.SHAPES["whisper-base"], 5, 16)


@pytest.mark.parametrize("input_grad", [True, False])
def test_variants_compute_the_layer_and_its_gradients(input_grad):
    """`fp8` is Float8Linear's training step and `fp8_matmuls` its matmuls on pre-quantized operands: equal to the
    bit; their output and input gradient within FP8 rounding of `bf16`, the weight gradient equal to it."""
    proj = dict(name="q_proj", rows=48, in_features=64, out_features=32, input_grad=input_grad, count=1)
    steps = bench.variant_steps(proj, torch.device("cpu"), torch.bfloat16, compile_layers=False)
    ref, fp8, matmuls = (steps[v]() for v in bench.VARIANTS)
    assert torch.equal(fp8[0], matmuls[0]) and torch.equal(fp8[1], matmuls[1])
    assert (fp8[2] is None) == (matmuls[2] is None) == (not input_grad)
    if input_grad:
        assert torch.equal(fp8[2], matmuls[2])
    assert torch.equal(fp8[1], ref[1])  # the weight gradient stays in the training precision
    for got, exact in zip(fp8[::2], ref[::2]):  # the output and the input gradient go through FP8
        if exact is not None:
            err = (got.float() - exact.float()).norm() / exact.float().norm()
            assert 0 < err < 0.1


def test_tiny_run_reports_every_projection(tmp_path):
    res = bench.main(
        [
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--eager",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    (shape,) = res["shapes"]
    assert [p["name"] for p in shape["projections"]] == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "fc",
    ]
    for p in shape["projections"]:
        assert p["saved_ms"] == pytest.approx(p["bf16_ms"] - p["fp8_ms"], abs=2e-4)
    assert shape["draft_side_total"]["bf16_ms"] == pytest.approx(
        sum(p["bf16_ms"] * p["count"] for p in shape["projections"]), abs=1e-3
    )
