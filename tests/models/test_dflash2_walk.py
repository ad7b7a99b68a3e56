"""DFlash2's greedy proposal (one batched transition table, a walk on device) equals the slot-by-slot selector
walk it replaced, kept here as the reference; the sampled proposal is still that walk."""

from __future__ import annotations

import pytest
import torch
from utils import tiny_draft_config

from dflash_hf import DFlash2DraftModel
from dflash_hf.models.modeling_dflash import _greedy_walk

HIDDEN, VOCAB = 32, 263
ROWS = (2, 3, 4, 5, 8, 9, 16, 17, 33)  # draft rows B (anchor + B-1 slots): a walk of 1 slot, powers of two and past


def reference_propose_block(draft, hidden, lm_head, anchor_token, temperature=0.0, generator=None):
    """The sequential walk `DFlash2DraftModel.propose_block` ran before: `forward` on one slot at a time."""
    selector = draft.candidate_selector
    logits = lm_head(hidden[1:]).float()
    unary, candidates = logits.topk(selector.top_k, dim=-1)
    q = logits.new_zeros(logits.shape) if temperature > 0 else None
    prev = torch.tensor(anchor_token, device=hidden.device)
    tokens = []
    for slot in range(logits.shape[0]):
        scores = selector(hidden[1 + slot], unary[slot], candidates[slot], prev)
        if q is None:
            choice = scores.argmax()
        else:
            probs = torch.softmax(scores / temperature, dim=-1)
            choice = torch.multinomial(probs, 1, generator=generator)[0]
            q[slot, candidates[slot]] = probs
        prev = candidates[slot, choice]
        tokens.append(prev)
    return torch.stack(tokens), q


def selector_draft(rank: int, top_k: int, dtype: torch.dtype, seed: int = 0):
    """A DFlash2 draft and an lm_head whose selector pair term is of the order of the logits (a nonzero successor
    codebook: a fresh one is zero and would hide any error of the walk behind the plain argmax)."""
    torch.manual_seed(seed)
    config = tiny_draft_config(
        {
            "mask_token_id": 5,
            "target_layer_ids": [1, 2],
            "conv_kernel_size": 2,
            "conv_group_size": 8,
            "selector_rank": rank,
            "selector_top_k": top_k,
        },
        architectures=["DFlash2DraftModel"],
        num_hidden_layers=1,
        num_target_layers=4,
        hidden_size=HIDDEN,
        head_dim=8,
        vocab_size=VOCAB,
    )
    draft = DFlash2DraftModel(config).eval().to(dtype)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).to(dtype)
    sel = draft.candidate_selector
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5)
        scale = (2 / rank) ** 0.25  # pair term ~ N(0, 2): the codebooks decide about as often as the logits
        sel.predecessor_codebook.copy_(torch.randn(VOCAB, rank, generator=g) * scale)
        sel.successor_codebook.copy_(torch.randn(VOCAB, rank, generator=g) * scale)
        sel.hidden_projection.weight.copy_(torch.randn(rank, HIDDEN, generator=g) / HIDDEN**0.5)
    return draft, lm_head


def compare(draft, lm_head, dtype, cases: int, seed: int) -> tuple[int, int, int]:
    """(mismatching proposals, proposals, proposals the pair term moved off the plain argmax)."""
    g = torch.Generator().manual_seed(seed)
    mismatches = total = moved = 0
    with torch.no_grad():
        for rows in ROWS:
            for _ in range(cases):
                hidden = torch.randn(rows, HIDDEN, generator=g).to(dtype)
                anchor = int(torch.randint(VOCAB, (), generator=g))
                tokens, q = draft.propose_block(hidden, lm_head, anchor)
                ref, _ = reference_propose_block(draft, hidden, lm_head, anchor)
                assert q is None and tokens.shape == ref.shape == (rows - 1,) and tokens.dtype == ref.dtype
                mismatches += int(not torch.equal(tokens, ref))
                moved += int(not torch.equal(ref, lm_head(hidden[1:]).argmax(-1)))
                total += 1
    return mismatches, total, moved


@pytest.mark.parametrize("rank,top_k", [(16, 6), (256, 16), (4, 1)])
@pytest.mark.slow  # 25 s on 2 busy cores
def test_greedy_walk_equals_sequential_walk_float64(rank, top_k):
    """float64 selector: batched and per-vector matmuls differ at most in the last float64 place, and the scores
    are float32 (as `forward` returns them), so a flip needs two candidates within ~1e-16 of each other: none
    occurs among these random scores, every proposal must be equal."""
    draft, lm_head = selector_draft(rank, top_k, torch.float64)
    mismatches, total, moved = compare(draft, lm_head, torch.float64, cases=25, seed=rank)
    assert mismatches == 0, f"{mismatches}/{total} proposals differ"
    if top_k > 1:  # the pair term really chooses (a zero successor codebook would walk to the argmax)
        assert moved > total // 2, (moved, total)


@pytest.mark.slow  # 20 s on 2 busy cores
def test_greedy_walk_equals_sequential_walk_float32_and_bf16():
    """float32 and bf16 selectors: the batched matmuls may round differently from the per-vector ones at the last
    place, which could flip a choice between candidates scored within a few ulps. None does in these cases
    (such a flip would not change decoded output: verification decides the tokens)."""
    for rank, top_k, dtype in ((16, 6, torch.float32), (256, 16, torch.float32), (16, 6, torch.bfloat16)):
        draft, lm_head = selector_draft(rank, top_k, dtype, seed=3)
        mismatches, total, _ = compare(draft, lm_head, dtype, cases=8, seed=7)
        assert mismatches == 0, f"{dtype}, rank {rank}, top_k {top_k}: {mismatches}/{total} proposals differ"
    with torch.no_grad():  # a block cut to the anchor alone (the last decoder position) proposes nothing
        tokens, q = draft.propose_block(torch.randn(1, HIDDEN, dtype=dtype), lm_head, 3)
    assert tokens.shape == (0,) and tokens.dtype == torch.long and q is None


def test_walk_is_the_chained_lookup():
    g = torch.Generator().manual_seed(0)
    for n in range(1, 40):
        for k in (1, 2, 5, 16):
            best = torch.randint(k, (n, k), generator=g)
            expected, c = [], int(best[0, 0])
            for s in range(n):
                c = int(best[s, c]) if s else c
                expected.append(c)
            assert _greedy_walk(best).tolist() == expected, (n, k)


def test_sampled_walk_is_unchanged():
    """Temperature > 0 still walks slot by slot: same generator, same tokens and same q, bit for bit."""
    draft, lm_head = selector_draft(16, 6, torch.float32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for rows in (2, 8, 16):
            hidden = torch.randn(rows, HIDDEN, generator=g)
            anchor = int(torch.randint(VOCAB, (), generator=g))
            tokens, q = draft.propose_block(hidden, lm_head, anchor, 0.8, torch.Generator().manual_seed(rows))
            ref, ref_q = reference_propose_block(
                draft, hidden, lm_head, anchor, 0.8, torch.Generator().manual_seed(rows)
            )
            assert torch.equal(tokens, ref) and torch.equal(q, ref_q)
            assert torch.allclose(q.sum(-1), torch.ones(rows - 1))
        tokens, q = draft.propose_block(torch.randn(1, HIDDEN), lm_head, 3, 0.8, torch.Generator().manual_seed(0))
    assert tokens.shape == (0,) and tokens.dtype == torch.long and q.shape == (0, VOCAB)  # the anchor alone


def test_proposals_make_no_host_tensor():
    """Neither proposal copies host data to the device (`torch.tensor` of the anchor id): the anchor indexes the
    codebook as a Python int."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostTensors(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            HostTensors.count += func is torch.ops.aten.lift_fresh.default
            return func(*args, **(kwargs or {}))

    draft, lm_head = selector_draft(16, 6, torch.float32)
    hidden = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), HostTensors():
        for temperature in (0.0, 0.8):
            draft.propose_block(hidden, lm_head, 5, temperature, torch.Generator().manual_seed(0))
    assert HostTensors.count == 0
