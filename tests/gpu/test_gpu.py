"""CUDA-only checks (marked `gpu`, skipped on CPU).

- Compiled FlexAttention against the dense-mask SDPA path: the same draft, features, blocks and frozen lm_head
  are run with a FlexAttention `BlockMask` (compiled flex on CUDA) and with the dense boolean mask (SDPA); the
  loss and every draft gradient must agree. Run as a script to print the measured differences as JSON:
  `python tests/gpu/test_gpu.py`.
- The draft side of a training micro-batch (target-argmax labels, blocks, mask, draft, loss, metrics, backward)
  never waits for the device: run under `torch.cuda.set_sync_debug_mode("error")`, any synchronizing call raises.
- Decoding with the draft's step captured as a CUDA graph (`dflash_hf.generation.fixed_draft`, the default on a GPU)
gives the
  eager loop's output and (fp32) its proposals, for a text and a Whisper encoder-context DFlash2 draft.
- FP8 draft linears (`float8_draft_linears`, compute capability >= 8.9): `torch._scaled_mm` eager and compiled
  against the dequantized references, and a micro-batch's draft side without a host sync; the FP8 lm_head gradient
  (`float8_lm_head`) with the compiled CE kernel.
- The frozen target's training forward replayed as a CUDA graph (`dflash_hf.targets.forward_graph`, `target_cuda_graph`)
  gives the eager forward's taps, final states and encoder frames bit for bit, without a host sync.
- Qwen3-ASR's audio windows found on the host (`families_qwen3_asr`) and Whisper's compact features rebuilt on the
  device (`whisper_features.expand_window`) give the features of the model's own forward on CUDA, the first with
  fewer synchronizations (counted by CUDA's sync debug mode).
"""

from __future__ import annotations

import json
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (utils) when run as a script

from utils import (
    GRAPH_CASES,
    assert_replays_match_eager,
    decode_with_proposals,
    graph_case,
    make_args,
    make_trainer,
    random_rows,
    text_batch,
    tiny_draft_config,
    tiny_text_target,
)

from dflash_hf import DFlashConfig
from dflash_hf.generation.fixed_draft import clear_fixed_draft_steps, fixed_draft_steps
from dflash_hf.models.modeling_dflash import DFlash2DraftModel, DFlashDraftModel
from dflash_hf.objective.blocks import attention_mask_for, build_blocks, doc_ids_from, row_positions, sample_anchors
from dflash_hf.objective.losses import block_loss
from dflash_hf.ops.float8 import FP8_MIN_CAPABILITY, Float8Linear, quantize
from dflash_hf.targets.builder import build_target_and_draft
from dflash_hf.targets.forward_graph import TargetForwardGraphs
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Norm-wise relative tolerance ||flex - sdpa|| / ||sdpa|| of the loss and of every gradient.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2}


def _tiny_draft(h: int, vocab: int, block: int, dtype: torch.dtype, compile_layers: bool, device: str):
    config = tiny_draft_config(
        {"mask_token_id": vocab - 1, "target_layer_ids": [1, 4, 6]},
        block_size=block,
        num_target_layers=8,
        hidden_size=h,
        intermediate_size=512,
        head_dim=64,
        vocab_size=vocab,
    )
    draft = DFlashDraftModel(config).to(device=device, dtype=dtype)
    if compile_layers:
        for layer in draft.layers:
            layer.compile()
    return draft


def flex_sdpa_differences(
    dtype: torch.dtype, compile_layers: bool = False, device: str = "cuda", seed: int = 0
) -> dict:
    """Loss and per-parameter gradient differences between the flex and the dense-mask paths
    (`compile_layers`: each decoder layer compiled, as `torch_compile_layers: [draft]`)."""
    torch.manual_seed(seed)
    h, vocab, block = 256, 1000, 16
    draft = _tiny_draft(h, vocab, block, dtype, compile_layers, device)
    b, s = 2, 300
    lengths = torch.tensor([300, 217])
    attention_mask = (torch.arange(s)[None] < lengths[:, None]).long()
    loss_mask = attention_mask.bool() & (torch.arange(s)[None] >= 40)
    ids = torch.randint(0, vocab - 1, (b, s))
    doc_ids = doc_ids_from(attention_mask)
    positions = row_positions(attention_mask)
    anchors = sample_anchors(loss_mask, doc_ids, 40, generator=torch.Generator().manual_seed(seed), pad_multiple=8)
    blocks = build_blocks(ids, ids, loss_mask, doc_ids, positions, anchors, block, vocab - 1, 7.0)
    blocks = type(blocks)(**{k: v if v is None else v.to(device) for k, v in vars(blocks).items()})
    taps = torch.randn(b, s, 3 * h, device=device, dtype=dtype) * attention_mask.to(device)[..., None]
    noise = torch.randn(b, anchors.shape[1] * block, h, device=device, dtype=dtype)
    lm_head = torch.randn(vocab, h, device=device, dtype=dtype) * h**-0.5
    pos = torch.cat([positions, blocks.positions.cpu().view(b, -1)], dim=1).to(device)

    results = {}
    for backend in ("flex", "sdpa"):
        draft.zero_grad(set_to_none=True)
        mask = attention_mask_for(backend, anchors.to(device), doc_ids.to(device), block)
        hidden = draft(position_ids=pos, attention_mask=mask, noise_embedding=noise, target_hidden=taps)
        out = block_loss(hidden.view(b, -1, block, h), blocks, lm_head, chunk_size=256)
        loss = out.loss_sum / out.weight_sum
        loss.backward()
        results[backend] = {"loss": loss.detach().float()} | {
            n: p.grad.detach().float().clone() for n, p in draft.named_parameters()
        }

    diffs = {}
    for name, ref in results["sdpa"].items():
        got = results["flex"][name]
        diffs[name] = {
            "max_abs": float((got - ref).abs().max()),
            "rel": float((got - ref).norm() / ref.norm().clamp(min=1e-30)),
        }
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "compiled_layers": compile_layers,
        "loss_flex": float(results["flex"]["loss"]),
        "loss_sdpa": float(results["sdpa"]["loss"]),
        "max_abs": max(d["max_abs"] for d in diffs.values()),
        "max_rel": max(d["rel"] for d in diffs.values()),
        "per_tensor": diffs,
    }


@needs_cuda
@pytest.mark.parametrize("compile_layers", [False, True], ids=["eager_layers", "compiled_layers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_flex_matches_dense_sdpa_loss_and_gradients(dtype, compile_layers):
    report = flex_sdpa_differences(dtype, compile_layers)
    assert len(report["per_tensor"]) > 10  # loss + every draft parameter (fc, norms, 2 layers)
    bad = {n: d for n, d in report["per_tensor"].items() if not d["rel"] <= TOLERANCE[dtype]}
    assert not bad, f"flex vs sdpa differ beyond {TOLERANCE[dtype]}: {bad}"


def _has_fp8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= FP8_MIN_CAPABILITY


@needs_cuda
@pytest.mark.parametrize(
    ("variant", "backend", "fp8"),
    [
        ("dflash", "flex", False),
        ("dflash", "sdpa", False),
        ("dflash2", "flex", False),
        ("dflash2", "sdpa", False),
        ("dflash", "flex", True),  # float8_draft_linears and float8_lm_head: the scales stay on the device
    ],
)
def test_draft_side_of_a_micro_batch_never_synchronizes(tmp_path, variant, backend, fp8):
    if fp8 and not _has_fp8():
        pytest.skip("needs FP8 tensor cores (compute capability >= 8.9)")
    model, tok = tiny_text_target(hidden_size=256)  # head_dim 64: compiled flex has no fp32 kernel for 16
    if fp8:
        model.resize_token_embeddings(272)  # float8_lm_head: a vocabulary that is a multiple of 16
    rows = random_rows(6, 250, resp_len=(20, 40))
    trainer = make_trainer(
        tmp_path,
        model,
        tok,
        rows,
        use_cpu=False,
        variant=variant,
        attention_backend=backend,
        label_source="target_argmax",
        torch_compile_layers=["draft"] if backend == "flex" else [],
        num_anchors=8,
        float8_draft_linears=fp8,
        float8_lm_head=fp8,
        precision="bf16" if fp8 else "fp32",  # FP8 trains in bf16
    )
    batch = text_batch(rows, tok.pad_token_id, padding_side="left")
    device_batch = {k: v.to(trainer.args.device) for k, v in batch.items()}
    draft = trainer.model

    # The frozen target's own forward is transformers code: its causal-mask helper reads the padding mask on the
    # host (`masking_utils.fast_all`), one sync per micro-batch that is not ours. Its features are captured
    # first; everything after them (labels, blocks, mask, draft, loss, metrics, backward) is checked.
    layer_ids = draft.config.target_layer_ids
    features = trainer.target.capture(device_batch, layer_ids, keep_final=True)
    trainer.target.capture = lambda batch, ids, keep_final=False, padded=None, host=None: features

    def micro_batch(check: bool):
        plan = trainer.objective.plan(trainer.target, device_batch, seed=0)  # before the step (get_batch_samples)
        total = plan.denominator.to(trainer.args.device)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if check else "default")
        try:
            loss = trainer.compute_loss(draft, dict(device_batch), plan=plan, num_items_in_batch=total)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return loss

    for _ in range(3):  # compiles outside the checked region (compilation itself synchronizes)
        micro_batch(check=False)
    loss = micro_batch(check=True)
    assert torch.isfinite(loss) and trainer.train_sums.reduce()["tau_est"] >= 1.0


@pytest.mark.skipif(not _has_fp8(), reason="needs FP8 tensor cores (compute capability >= 8.9)")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_float8_linear_matches_its_dequantized_references_on_cuda(compiled):
    """`torch._scaled_mm` on the GPU (eager, and inside a compiled module as `torch_compile_layers: [draft]` runs
    it) computes the matmuls of the dequantized operands: forward, input gradient, and the exact weight gradient."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(1024, 2048, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():  # rows and columns of very different sizes: a scale applied along the wrong axis shows
        layer.weight.mul_(
            torch.logspace(-2, 2, 2048, device="cuda")[:, None] * torch.logspace(1, -1, 1024, device="cuda")
        )
    layer.__class__ = Float8Linear
    layer.train()
    run = torch.compile(layer) if compiled else layer
    rows = torch.logspace(-1, 1, 300, device="cuda")[:, None]  # 300 rows: not a multiple of 16
    x = (torch.randn(300, 1024, device="cuda") * rows).to(torch.bfloat16).requires_grad_()
    y = run(x)
    g = torch.randn_like(y)
    y.backward(g)

    def deq(t, dim):
        q, scale = quantize(t, dim)
        return q.float() * scale

    w = layer.weight.detach()
    refs = {
        "y": deq(x.detach(), -1) @ deq(w, -1).t(),
        "grad_x": deq(g, -1) @ deq(w, 0),
        "grad_w": g.float().t() @ x.detach().float(),
    }
    for name, got in {"y": y.detach(), "grad_x": x.grad, "grad_w": layer.weight.grad}.items():
        rel = ((got.float() - refs[name]).norm() / refs[name].norm()).item()
        assert rel < 1e-2, f"{name}: relative difference {rel:.3g}"


@pytest.mark.skipif(not _has_fp8(), reason="needs FP8 tensor cores (compute capability >= 8.9)")
def test_float8_lm_head_keeps_the_loss_and_gives_the_dequantized_gradient_on_cuda():
    """`float8_lm_head` on the GPU, where the CE kernel is compiled (Triton) and writes e4m3 rows: the argmax equals
    the bf16 fused kernel's and the loss up to rounding, the rows are eager's (up to a rare last-step flip), and the
    input gradient is near the exact one, further than bf16's; a 151,936-word lm_head in chunks of two sizes."""
    from dflash_hf.objective.losses import fused_lm_head_ce
    from dflash_hf.ops.fused_ce import _ce_and_logit_grad, _ce_grad

    torch.manual_seed(0)
    v, h, m = 151936, 1024, 3000
    weight = (torch.randn(v, h, device="cuda") / h**0.5).to(torch.bfloat16)
    hidden = (torch.randn(m, h, device="cuda") * 3).to(torch.bfloat16)
    labels = torch.randint(0, v, (m,), device="cuda")
    weights = torch.rand(m, device="cuda") + 0.1
    out = {}
    for fp8 in (False, True):
        x = hidden.clone().requires_grad_()
        loss, pred = fused_lm_head_ce(x, weight, labels, weights, 2048, fp8=fp8)
        loss.backward()
        out[fp8] = (loss.detach(), pred, x.grad.float())
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-6, atol=0)  # two compiled graphs: rounding
    assert torch.equal(out[True][1], out[False][1])
    logits = hidden.float() @ weight.float().t()
    delta = torch.softmax(logits, -1)
    delta[torch.arange(m, device="cuda"), labels] -= 1
    exact = (delta * weights[:, None]) @ weight.float()
    rel = ((out[True][2] - exact).norm() / exact.norm()).item()
    rel_bf16 = ((out[False][2] - exact).norm() / exact.norm()).item()
    assert rel < 0.06 and rel_bf16 < rel, f"FP8 {rel:.3g}, bf16 {rel_bf16:.3g}"
    chunk = (hidden[:952] @ weight.t(), labels[:952], weights[:952], True, True)  # the compiled kernel and eager's
    compiled_rows, eager_rows = _ce_grad(*chunk)[2].float(), _ce_and_logit_grad(*chunk)[2].float()
    assert (compiled_rows != eager_rows).float().mean().item() < 1e-3


@needs_cuda
def test_compiled_flex_keeps_compiled_kernels_as_shapes_change(tmp_path):
    """Training batches change length and anchor count. With dynamo's recompile limit made fatal, 12 shapes
    in a row must keep running compiled kernels (layers, flex, mask construction, CE), never eager flex, and
    match the dense-mask path on every batch."""
    model, tok = tiny_text_target(hidden_size=256)  # head_dim 64: compiled flex has no fp32 kernel for 16
    trainer = make_trainer(
        tmp_path,
        model,
        tok,
        random_rows(2, 250),
        use_cpu=False,
        attention_backend="flex",
        torch_compile_layers=["draft"],
        num_anchors=32,
    )
    draft = trainer.model
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for i in range(12):
            rows = random_rows(3 + i % 3, 250, resp_len=(10 + 9 * i, 20 + 11 * i), seed=i)
            batch = {k: v.to(trainer.args.device) for k, v in text_batch(rows, tok.pad_token_id).items()}
            trainer.args.attention_backend = "flex"
            plan = trainer.objective.plan(trainer.target, batch, seed=i)  # with the flex tile layout
            loss = trainer.compute_loss(draft, dict(batch), plan=plan)
            loss.backward()
            trainer.args.attention_backend = "sdpa"
            with torch.no_grad():
                ref = trainer.compute_loss(draft, dict(batch), plan=plan)
            assert abs(float(loss) - float(ref)) <= 1e-4 * abs(float(ref)), (i, float(loss), float(ref))
    eager_flex = [str(w.message) for w in got if "called without torch.compile" in str(w.message)]
    assert not eager_flex, eager_flex


def _graph_and_eager_agree(draft, target, max_new_tokens, **inputs):
    clear_fixed_draft_steps(draft)
    graph, graph_props = decode_with_proposals(draft, target, max_new_tokens, None, **inputs)  # auto: a graph
    steps = list(fixed_draft_steps(draft).values())
    assert len(steps) == 1 and steps[0].graph is not None and graph.draft_step == "cuda graph"
    eager, eager_props = decode_with_proposals(draft, target, max_new_tokens, False, **inputs)
    assert torch.equal(graph.sequences, eager.sequences)  # lossless either way
    assert len(graph_props) == len(eager_props) > 2
    agree = sum(int((a == b).sum()) for a, b in zip(graph_props, eager_props))
    assert agree >= 0.95 * sum(p.numel() for p in eager_props), (agree, graph_props, eager_props)


@needs_cuda
def test_cuda_graph_draft_step_decodes_as_the_eager_loop(tmp_path):
    model, _ = tiny_text_target(seed=3)
    ft = FrozenTarget(tiny.sharpen(model, seed=3).cuda())
    cfg = DFlashConfig.from_target_config(
        ft.text_config, mask_token_id=3, num_hidden_layers=2, block_size=8, variant="dflash2"
    )
    cfg.vocab_size = ft.vocab_size
    torch.manual_seed(1)
    draft = DFlash2DraftModel(cfg).cuda().eval()
    with torch.no_grad():
        draft.candidate_selector.successor_codebook.normal_(0, 0.5)
    for length in (5, 19):
        ids = torch.randint(4, ft.vocab_size, (1, length), generator=torch.Generator().manual_seed(length)).cuda()
        _graph_and_eager_agree(draft, ft, 40, input_ids=ids)
    whisper, processor = tiny.build_whisper_target(hidden_size=32, num_heads=2, seed=2)
    whisper = tiny.sharpen(whisper, seed=2).cuda()
    args = make_args(
        tmp_path, mask_token_id=364, num_draft_layers=2, draft_encoder_context=True, block_size=4, variant="dflash2"
    )
    torch.manual_seed(0)
    wdraft = build_target_and_draft(FrozenTarget(whisper), args).draft.cuda().eval()
    feats = processor.feature_extractor(torch.randn(16000).numpy() * 0.1, sampling_rate=16000, return_tensors="pt")[
        "input_features"
    ].cuda()
    _graph_and_eager_agree(wdraft, whisper, 24, input_features=feats)


@needs_cuda
@pytest.mark.parametrize("side", ["right", "left"])
def test_prebuilt_padded_decoder_mask_gives_transformers_taps_on_cuda(side):
    """The padded batch's decoder mask built on the device (`FrozenTarget.padded_decoder_mask`) against
    transformers' own (an expanded view of the same values): bit-identical taps on CUDA too (the CPU check is in
    tests/targets/test_target_masks.py)."""
    model, tok = tiny_text_target(hidden_size=256)
    target = FrozenTarget(model.cuda())
    batch = {k: v.cuda() for k, v in text_batch(random_rows(3, 250, seed=4), tok.pad_token_id, side).items()}
    ref = target.capture(batch, [1, 2], keep_final=True)
    got = target.capture(batch, [1, 2], keep_final=True, padded=True)
    assert torch.equal(got.taps, ref.taps) and torch.equal(got.final_hidden, ref.final_hidden)


@contextmanager
def _no_sync():
    """Any synchronizing call inside raises (after the device has caught up with the work queued before)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_target_forward_graph_replays_the_eager_features(case):
    """`target_cuda_graph`: a signature captured at its second sighting replays the eager features bit for bit (taps,
    final states, Whisper's encoder frames) for batches whose padding or document boundaries differ from the captured
    one's, and a replay reads nothing back to the host."""
    model, batches = graph_case(case, hidden_size=256)
    target = FrozenTarget(model.cuda())
    graphs = target.forward_graphs = TargetForwardGraphs(True)
    cuda = [{k: v.cuda() if torch.is_tensor(v) else v for k, v in b.items()} for b in batches]
    assert_replays_match_eager(target, cuda, GRAPH_CASES[case], last_call=_no_sync)
    assert graphs.replays == 2 and len(graphs.graphs) == 1


def _syncs(fn) -> tuple[object, int]:
    """`fn()` and the synchronizations it made (CUDA's sync debug mode warns once for each)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sum("synchroniz" in str(w.message) for w in seen)


@needs_cuda
def test_qwen3_asr_host_windows_give_the_features_with_fewer_syncs_on_cuda(tmp_path):
    from dflash_hf.data import build_train_dataloader

    model, processor = tiny.build_qwen3_asr_target(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2)
    manifest = tiny.synthesize_speech(tmp_path, 4, seed=4, min_dur=0.6, max_dur=1.6)
    batch = next(iter(build_train_dataloader(manifest, processor, model.config, max_tokens=100_000, shuffle=False)))
    target = FrozenTarget(model.cuda())
    host = target.host_facts(batch)
    cuda = {k: v.cuda() for k, v in batch.items()}
    assert host is not None and target.host_facts(cuda) is None  # found on the host batch only
    ref, theirs = _syncs(lambda: target.capture(cuda, [0, 1], keep_final=True))
    got, ours = _syncs(lambda: target.capture(cuda, [0, 1], keep_final=True, host=host))
    assert torch.equal(got.taps, ref.taps) and torch.equal(got.final_hidden, ref.final_hidden)
    assert ours < theirs, (ours, theirs)


@needs_cuda
def test_whisper_compact_features_give_the_whole_windows_features_on_cuda(tmp_path):
    from utils import tiny_whisper

    from dflash_hf.data import build_train_dataloader

    model, processor = tiny_whisper()
    target = FrozenTarget(model.cuda())
    target.forward_graphs = TargetForwardGraphs(None)
    manifest = tiny.synthesize_speech(tmp_path, 6, seed=0)
    pairs = zip(
        build_train_dataloader(manifest, processor, model.config, max_tokens=400, shuffle=False, compact_features=True),
        build_train_dataloader(manifest, processor, model.config, max_tokens=400, shuffle=False),
    )
    for compact, whole in pairs:
        assert "input_features_compact" in compact and "input_features" in whole
        for _ in range(3):  # eager, captured, replayed
            got = target.capture({k: v.cuda() for k, v in compact.items()}, [0, 1], keep_final=True, padded=True)
            ref = target.capture({k: v.cuda() for k, v in whole.items()}, [0, 1], keep_final=True, padded=True)
            assert torch.equal(got.taps, ref.taps) and torch.equal(got.encoder_hidden, ref.encoder_hidden)


@needs_cuda
def test_whisper_waves_give_the_cpu_features_up_to_rounding_on_cuda(tmp_path):
    """The trainer's Whisper batches hold padded waves; their log-mel computed on the GPU (cuFFT, the mel projection
    in float64) is the extractor's CPU features up to float rounding, and so are the taps."""
    from utils import tiny_whisper

    from dflash_hf.data import build_train_dataloader

    model, processor = tiny_whisper()
    target = FrozenTarget(model.cuda())
    manifest = tiny.synthesize_speech(tmp_path, 6, seed=0)
    pairs = zip(
        build_train_dataloader(
            manifest,
            processor,
            model.config,
            max_tokens=400,
            shuffle=False,
            compact_features=True,
            device_features=True,
        ),
        build_train_dataloader(manifest, processor, model.config, max_tokens=400, shuffle=False),
    )
    for waves, whole in pairs:
        assert "input_audio_waves" in waves
        got = target.whole_window({k: v.cuda() for k, v in waves.items()})["input_features"]
        torch.testing.assert_close(got.cpu(), whole["input_features"], rtol=0, atol=1e-4)
        taps = target.capture({k: v.cuda() for k, v in waves.items()}, [0, 1], keep_final=True, padded=True)
        ref = target.capture({k: v.cuda() for k, v in whole.items()}, [0, 1], keep_final=True, padded=True)
        torch.testing.assert_close(taps.taps, ref.taps, rtol=1e-3, atol=1e-3)


if __name__ == "__main__":
    cases = [(dtype, c) for c in (False, True) for dtype in (torch.float32, torch.bfloat16)]
    print(json.dumps([flex_sdpa_differences(dtype, c) for dtype, c in cases], indent=1))
