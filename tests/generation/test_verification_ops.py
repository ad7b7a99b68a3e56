"""Per-cycle work of the decode loop and the draft, each checked against what it replaced and counted in operators
(not timed): Whisper's suppression processors with masks built once per decode, greedy acceptance compared on the
host, the block ids joined only when a processor reads them, the draft RoPE's kept inverse frequencies."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
)
from utils import DispatchedOps

from dflash_hf.generation.verify_rules import accept_greedy_prefix, processed_scores, with_cached_masks


def random_scores(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, vocab, generator=g)
    scores[0, 1] = float("-inf")  # already suppressed, NaN and +inf stay as the processor leaves them
    scores[-1, 2] = float("nan")
    scores[rows // 2, 0] = float("inf")
    return scores


@pytest.mark.parametrize("vocab", [7, 51, 263])
def test_cached_suppression_equals_the_processors(vocab):
    g = torch.Generator().manual_seed(vocab)
    tokens = torch.randint(vocab + 3, (5,), generator=g).tolist() + [0, 0]  # repeats, ids past the vocabulary
    begin_tokens = torch.randint(vocab, (2,), generator=g).tolist()
    processors = LogitsProcessorList(
        [SuppressTokensLogitsProcessor(tokens), SuppressTokensAtBeginLogitsProcessor(begin_tokens, begin_index=4)]
    )
    cached = with_cached_masks(processors)
    assert [type(p).__name__ for p in cached] == ["_CachedSuppression", "_CachedBeginSuppression"]
    for call in range(3):  # the mask is built at the first call and reused
        for length in (3, 4, 5):  # the begin suppression applies when the ids are begin_index long
            ids = torch.arange(length)[None]
            scores = random_scores(1, vocab, seed=10 * call + length)
            for mine, theirs in zip(cached, processors):
                got, expected = mine(ids, scores.clone()), theirs(ids, scores.clone())
                assert torch.equal(got.isnan(), expected.isnan()), (call, length)
                assert torch.equal(got.nan_to_num(), expected.nan_to_num())
    bigger = random_scores(2, vocab + 5, seed=1)  # another vocabulary size: the mask is rebuilt
    ids = torch.arange(4)[None]
    for mine, theirs in zip(cached, processors):
        assert torch.equal(mine(ids, bigger).nan_to_num(), theirs(ids, bigger).nan_to_num())
    processors[1].set_begin_index(5)  # begin_index is read from the processor at each call
    ids = torch.arange(5)[None]
    assert torch.equal(cached[1](ids, bigger).nan_to_num(), processors[1](ids, bigger).nan_to_num())
    assert cached[1](torch.arange(4)[None], bigger) is bigger  # not at begin_index: untouched, as the processor


def test_block_scores_with_cached_masks_equal_the_processors_token_by_token():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    prefix = torch.arange(12)[None]  # row i follows prefix[:, :9 + i]
    for begin_index in (8, 9, 10, 12, 13):
        processors = LogitsProcessorList(
            [
                SuppressTokensLogitsProcessor([3, 7]),
                TemperatureLogitsWarper(0.7),
                SuppressTokensAtBeginLogitsProcessor([5, 6], begin_index),
            ]
        )
        expected = torch.cat([processors(prefix[:, : 9 + i], logits[i : i + 1]) for i in range(4)])
        got = processed_scores(with_cached_masks(processors), prefix, logits)
        assert torch.equal(got, expected), begin_index


def test_cached_suppression_dispatches_one_operator_after_its_first_call():
    processors = with_cached_masks(LogitsProcessorList([SuppressTokensLogitsProcessor([3, 7])]))
    prefix, logits = torch.arange(12)[None], torch.randn(8, 51865)
    processed_scores(processors, prefix, logits)  # builds the mask
    with DispatchedOps() as ops:
        processed_scores(processors, prefix, logits)
    assert ops.names == ["aten.masked_fill.Scalar"]  # transformers' processor: arange, isin, where (and a scalar)


def reference_accept(draft_tokens, target_scores):
    """The prefix-match rule as the loop computed it on the device."""
    t = target_scores.argmax(-1)
    k = int((draft_tokens == t[: draft_tokens.shape[0]]).long().cumprod(0).sum())
    return k, t[: k + 1], t[: k + 1].tolist()


def test_greedy_acceptance_equals_the_prefix_match_and_dispatches_two_operators():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = trial % 8  # 0 draft tokens (a block of the anchor alone) to 7
        scores = torch.randn(n + 1, 11, generator=g)
        t = scores.argmax(-1)
        cut = int(torch.randint(n + 1, (), generator=g))  # agree up to `cut`, then (maybe) differ
        draft = torch.cat([t[:cut], torch.randint(11, (n - cut,), generator=g)]) if n else t[:0]
        k, new, new_ids = accept_greedy_prefix(draft, scores)
        ref_k, ref_new, ref_ids = reference_accept(draft, scores)
        assert (k, new_ids) == (ref_k, ref_ids) and torch.equal(new, ref_new), trial
    with DispatchedOps() as ops:
        accept_greedy_prefix(draft, scores)
    assert ops.names == ["aten.argmax.default", "aten.cat.default"]


def test_block_ids_are_joined_only_for_a_processor_that_reads_them():
    """`processed_scores(processors, seq, logits, block)` equals `processed_scores` of the joined ids, and joins them
    (one `cat` of ids) only when a processor is given ids past `seq`."""

    class LastIdBias:  # reads the ids: a processor applied row by row
        def __call__(self, input_ids, scores):
            return scores + input_ids[:, -1:].float()

    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    seq, block = torch.arange(9)[None], torch.tensor([11, 12, 13])  # row i follows seq + block[:i]
    joined = torch.cat([seq, block[None]], dim=1)
    for begin_index, reads in ((9, False), (10, True), (12, True), (13, False)):
        for extra in ([], [LastIdBias()]):
            processors = with_cached_masks(
                LogitsProcessorList(
                    [SuppressTokensLogitsProcessor([3]), SuppressTokensAtBeginLogitsProcessor([5], begin_index), *extra]
                )
            )
            expected = processed_scores(processors, joined, logits)
            with DispatchedOps() as ops:
                got = processed_scores(processors, seq, logits, block)
            assert torch.equal(got, expected), (begin_index, extra)
            id_cats = ops.names.count("aten.cat.default") - (begin_index - 9 in range(4)) - bool(extra)
            assert id_cats == (1 if reads or extra else 0), (begin_index, extra, ops.names)


def test_rope_keeps_its_float32_inverse_frequencies():
    """The draft's RoPE computes its inverse frequencies once per device (float32 also in a bf16 draft) and gives
    the cos/sin of the formula it computed at every call, bit for bit."""
    from utils import tiny_draft_config

    from dflash_hf.models.modeling_dflash import DFlashRotaryEmbedding

    rope = DFlashRotaryEmbedding(tiny_draft_config({}, hidden_size=64, head_dim=16)).to(torch.bfloat16)
    positions = torch.arange(40)[None]
    exponent = torch.arange(0, rope.head_dim, 2, dtype=torch.float32)
    freqs = positions.float()[..., None] * (1.0 / (rope.rope_theta ** (exponent / rope.head_dim)))
    emb = torch.cat((freqs, freqs), dim=-1)
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        cos, sin = rope(positions, dtype)
        assert torch.equal(cos, emb.cos().to(dtype)) and torch.equal(sin, emb.sin().to(dtype))
    assert rope.inv_freq(positions.device).dtype == torch.float32
    with DispatchedOps() as ops:
        rope(positions, torch.float32)
    assert "aten.arange.start_step" not in ops.names and "aten.pow.Scalar" not in ops.names


def test_rope_inverse_frequencies_follow_a_changed_setting_and_a_moved_tensor():
    """The kept frequencies are keyed by the settings too, and a kept tensor on another device than its key (a
    whole-module pickle loaded elsewhere) is recomputed, never used."""
    from utils import tiny_draft_config

    from dflash_hf.models.modeling_dflash import DFlashRotaryEmbedding

    rope = DFlashRotaryEmbedding(tiny_draft_config({}, hidden_size=64, head_dim=16))
    cpu = torch.device("cpu")
    first = rope.inv_freq(cpu)
    rope.rope_theta *= 2
    assert not torch.equal(rope.inv_freq(cpu), first)
    key = (cpu, rope.rope_theta, rope.head_dim)
    rope.__dict__["_inv_freq"][key] = torch.empty(first.shape, device="meta")
    assert rope.inv_freq(cpu).device == cpu


def test_cached_suppression_hands_over_to_the_processor_when_they_differ():
    """If the target's processor ever computed something else than the cached mask (another transformers), the
    wrapper returns the processor's scores at the first call and hands it every later call."""

    class Different(SuppressTokensLogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores * 2.0

    wrapped = with_cached_masks(LogitsProcessorList([SuppressTokensLogitsProcessor([1, 3])]))[0]
    ids, scores = torch.zeros(1, 4, dtype=torch.long), random_scores(3, 9, seed=5)
    wrapped(ids, scores)
    assert not wrapped.delegate  # the real processor: the same scores, the cache stays in use
    wrapped.processor = Different([1, 3])
    wrapped.mask = None  # rebuilt (and compared) at the next call
    for _ in range(2):
        out = wrapped(ids, scores)
        assert torch.allclose(out, scores * 2.0, equal_nan=True) and wrapped.delegate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_rmsnorm_equals_the_written_out_formula_with_its_gradients(dtype):
    """`DFlashRMSNorm` (through `F.rms_norm`, one kernel on CUDA) gives the float32 formula of Qwen3's RMSNorm bit
    for bit on the CPU, values and gradients, so CPU training and decoding are unchanged by it."""
    from dflash_hf.models.modeling_dflash import DFlashRMSNorm

    g = torch.Generator().manual_seed(0)
    for shape in ((3, 7, 64), (2, 5, 4, 16), (33, 576)):
        norm = DFlashRMSNorm(shape[-1], eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(shape[-1], generator=g))
        x = (3 * torch.randn(shape, generator=g)).to(dtype).requires_grad_(True)
        y = x.float()
        expected = norm.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        want = torch.autograd.grad(expected.float().square().sum(), (x, norm.weight))
        got_y = norm(x)
        got = torch.autograd.grad(got_y.float().square().sum(), (x, norm.weight))
        assert torch.equal(got_y, expected) and all(torch.equal(a, b) for a, b in zip(got, want)), shape
