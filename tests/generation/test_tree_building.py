"""Token trees from one draft forward and what the target's scores accept over them (`generation.tree`,
`generation.tree_accept`): the best-first tree holds the best paths with the draft's chain first, greedy acceptance
walks the target's argmax and never accepts less than the chain, and sampled acceptance keeps the target's
distribution (the chain's statistical test)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, SuppressTokensAtBeginLogitsProcessor
from utils import DispatchedOps, chi_square_p_value

from dflash_hf import DFlash2DraftModel, DFlashConfig, DFlashDraftModel
from dflash_hf.generation.tree import SelectorScores, SlotScores, build_tree, draft_scores, tree_nodes
from dflash_hf.generation.tree_accept import accept_greedy, accept_sampled, node_ids, tree_processed
from dflash_hf.generation.verify_rules import processed_scores
from dflash_hf.testing import tiny


def _paths(tree) -> list[tuple[int, ...]]:
    """Each node's path of candidate-free tokens, from the tree's parents (node 0: the root, empty)."""
    parents, tokens = [0, *tree.parents.tolist()], [None, *tree.tokens.tolist()]
    paths = [()]
    for n in range(1, len(parents)):
        assert parents[n] < n  # parents come before their children
        paths.append((*paths[parents[n]], tokens[n]))
    return paths


def _best_paths(candidates, logq, greedy, nodes):
    """Brute force: every candidate path, the chain's first, then by decreasing path log-probability."""
    depth, width = candidates.shape
    ranked = []
    for d in range(1, depth + 1):
        for choice in itertools.product(range(width), repeat=d):
            rows = [0, *choice[:-1]] if logq.shape[1] > 1 else [0] * d
            score = sum(float(logq[s, rows[s], choice[s]]) for s in range(d))
            chain = all(choice[s] == int(greedy[s, rows[s]]) for s in range(d))
            ranked.append((chain, score, tuple(int(candidates[s, choice[s]]) for s in range(d))))
    ranked.sort(key=lambda r: (not r[0], -r[1]))
    return {r[2] for r in ranked[:nodes]}


def _scores(kind: str, seed: int, depth: int = 3, vocab: int = 7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=g) * 2
    if kind == "slots":
        return SlotScores(logits)
    candidates = logits.topk(3, dim=-1).indices
    return SelectorScores(candidates, torch.randn(depth, 3, 3, generator=g) * 2, vocab)


@pytest.mark.parametrize("kind", ["slots", "selector"])
def test_the_tree_holds_the_best_paths_with_the_draft_chain_first(kind):
    for seed, budget in itertools.product(range(3), (1, 2, 3, 5, 9, 20)):
        scores = _scores(kind, seed)
        width = 3 if kind == "selector" else min(budget, 7)
        candidates, logq, greedy = scores.candidates(width)
        nodes = tree_nodes(budget, 3, width)
        tree = build_tree(candidates, logq, greedy, nodes)
        paths = _paths(tree)
        assert set(paths[1:]) == _best_paths(candidates, logq, greedy, nodes), (seed, budget)
        chain = [paths[d] for d in range(1, min(nodes, 3) + 1)]  # nodes 1..D: the chain, by depth
        assert [len(p) for p in chain] == list(range(1, len(chain) + 1))
        assert all(chain[i] == chain[i + 1][:-1] for i in range(len(chain) - 1))
        parents = [0, *tree.parents.tolist()]
        for n in range(nodes + 1):  # ancestors: the node, its parent's ancestors, down to the root
            expected, m = {n}, n
            while m:
                m = parents[m]
                expected.add(m)
            assert set(tree.ancestors[n].nonzero().flatten().tolist()) == expected
        assert tree.depth.tolist() == [len(p) for p in paths]


def test_the_chain_is_the_draft_greedy_proposal():
    """Nodes 1..D of any tree of at least D nodes are the draft's own greedy proposal (DFlash: argmax per slot;
    DFlash2: the selector walk), whatever the budget."""
    tcfg = tiny.build_text_target(tiny.build_tokenizer(), hidden_size=32, num_layers=2, num_heads=2).config
    torch.manual_seed(0)
    v2 = dict(variant="dflash2", conv_group_size=8, selector_top_k=4)
    for cls, extra in ((DFlashDraftModel, {}), (DFlash2DraftModel, v2)):
        cfg = DFlashConfig.from_target_config(tcfg, mask_token_id=3, num_hidden_layers=1, block_size=5, **extra)
        draft = cls(cfg).eval()
        if cls is DFlash2DraftModel:
            with torch.no_grad():
                draft.candidate_selector.successor_codebook.normal_(0, 0.5)
        lm_head = torch.nn.Linear(32, tcfg.vocab_size, bias=False)
        hidden = torch.randn(5, 32)
        with torch.no_grad():
            chain = draft.propose_block(hidden, lm_head, 7, 0.0, None)[0] if cls is DFlash2DraftModel else None
            chain = lm_head(hidden[1:]).argmax(-1) if chain is None else chain
            scores = draft_scores(draft, hidden, lm_head, 7)
            for budget in (4, 9, 30):
                width = 4 if cls is DFlash2DraftModel else budget
                tree = build_tree(*scores.candidates(width), tree_nodes(budget, 4, width))
                assert torch.equal(tree.tokens[:4], chain) and tree.parents[:4].tolist() == [0, 1, 2, 3]
            assert build_tree(*scores.candidates(4), 4).nodes == 4  # budget D: the chain alone


def test_tree_nodes_counts_the_paths_the_slots_make():
    assert tree_nodes(8, 3, 2) == 8 and tree_nodes(100, 3, 2) == 2 + 4 + 8 and tree_nodes(5, 1, 3) == 3
    assert tree_nodes(64, 15, 64) == 64 and tree_nodes(3, 15, 1) == 3


def _walk(tree, target: list[int], max_depth: int) -> list[int]:
    """Reference greedy walk on the host: the root, then the child equal to the argmax, while there is one."""
    parents, tokens, depth = [0, *tree.parents.tolist()], [None, *tree.tokens.tolist()], tree.depth.tolist()
    path = [0]
    while True:
        kids = [n for n in range(1, len(parents)) if parents[n] == path[-1] and depth[n] <= max_depth]
        nxt = [n for n in kids if tokens[n] == target[path[-1]]]
        if not nxt:
            return path
        path.append(nxt[0])


def _device_nodes(out) -> list[int]:
    """The accepted path's nodes as the cycle gathers them: nodes `0..k` on the chain, else `off_chain`."""
    return list(range(out.k + 1)) if out.off_chain is None else out.off_chain.tolist()


def test_greedy_acceptance_walks_the_argmax_and_never_accepts_less_than_the_chain():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        scores = _scores("slots" if trial % 2 else "selector", trial, depth=4, vocab=5)
        tree = build_tree(*scores.candidates(3 if trial % 2 == 0 else 5), tree_nodes(12, 4, 3))
        target_scores = torch.randn(tree.nodes + 1, 5, generator=g)
        # make the target agree with the tree often: each node's argmax is a random child's token
        for n in range(tree.nodes + 1):
            kids = (tree.parents == n).nonzero().flatten()
            if len(kids) and trial % 3:
                target_scores[n, tree.tokens[kids[trial % len(kids)]]] = 10.0
        max_depth = 4 if trial % 4 else 2
        out = accept_greedy(tree, target_scores, max_depth)
        target = target_scores.argmax(-1).tolist()
        path = _walk(tree, target, max_depth)
        assert out.path == path and out.k == len(path) - 1 and _device_nodes(out) == path
        assert out.new_ids == [target[n] for n in path] and out.new.tolist() == out.new_ids
        chain_k = next((d for d in range(min(4, max_depth)) if int(tree.tokens[d]) != target[d]), min(4, max_depth))
        assert out.k >= chain_k


def test_greedy_acceptance_runs_the_chains_operators_on_any_tree_with_ties():
    """Random trees of every budget, target scores full of ties (the argmax is the first maximum, as `generate`'s):
    the path is the reference walk's, the new tokens the first maxima along it, and the device runs the chain's two
    operators (argmax, one concatenation read back once) on the chain, one more off it (the argmax at the path's
    nodes)."""
    g = torch.Generator().manual_seed(7)
    seen = Counter()
    for trial in range(60):
        depth, vocab = 5, 6
        scores = _scores("slots" if trial % 2 else "selector", trial, depth=depth, vocab=vocab)
        width = 3 if trial % 2 == 0 else 1 + trial % vocab
        tree = build_tree(*scores.candidates(width), tree_nodes(1 + trial % 40, depth, width))
        target_scores = torch.randint(0, 2, (tree.nodes + 1, vocab), generator=g).float()  # ties everywhere
        for n in range(tree.nodes + 1):  # follow the tree often: a random child's token among the maxima
            kids = (tree.parents == n).nonzero().flatten()
            if len(kids) and trial % 3:
                target_scores[n, tree.tokens[kids[trial % len(kids)]]] = 1.0
        max_depth = depth if trial % 4 else 1 + trial % depth
        with DispatchedOps() as ops:
            out = accept_greedy(tree, target_scores, max_depth)
        rows = target_scores.tolist()
        target = [row.index(max(row)) for row in rows]  # the first maximum
        path = _walk(tree, target, max_depth)
        assert out.path == path and out.k == len(path) - 1 and _device_nodes(out) == path
        assert out.new_ids == [target[n] for n in path] and out.new.tolist() == out.new_ids
        assert out.on_chain == (path == list(range(len(path))))
        expected = ["aten.argmax.default", "aten.cat.default"]
        if not out.on_chain:
            expected += ["aten.index.Tensor"]
        assert ops.names == expected, ops.names
        seen[out.on_chain, out.k > 0] += 1
    assert len(seen) == 3, seen  # on the chain (empty and not) and off it


def test_tree_rows_are_processed_as_each_node_path_would_be():
    """Row-wise, begin-index and general processors give each node's row what `generate`'s processors give its
    path."""
    g = torch.Generator().manual_seed(1)
    scores = _scores("slots", 4, depth=3, vocab=9)
    tree = build_tree(*scores.candidates(3), 8)
    prefix = torch.tensor([[1, 2, 3]])
    logits = torch.randn(tree.nodes + 1, 9, generator=g)
    processors = LogitsProcessorList(
        [RepetitionPenaltyLogitsProcessor(1.7), SuppressTokensAtBeginLogitsProcessor([4, 5], begin_index=4)]
    )
    out = tree_processed(processors, prefix, logits, tree)
    for n, ids in enumerate(node_ids(prefix, tree)):
        assert torch.equal(out[n : n + 1], processed_scores(processors, ids, logits[n : n + 1])), n
    assert torch.isinf(out[tree.depth == 1][:, [4, 5]]).all() and not torch.isinf(out[tree.depth != 1]).any()


def _sampling_case(kind: str):
    """A 4-token target, its logits after (t1) and after (t1, t2) for every anchor t1, and a draft of block 3."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = 4
    tcfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        pad_token_id=None,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(tcfg).eval()
    tiny.sharpen(target, seed=3, embed_std=0.3, layer_std=0.2)
    extra = dict(conv_group_size=8, selector_rank=16, selector_top_k=2) if kind == "selector" else {}
    cfg = DFlashConfig.from_target_config(
        tcfg,
        mask_token_id=3,
        variant="dflash2" if extra else "dflash",
        num_hidden_layers=1,
        block_size=3,
        target_layer_ids=[0],
        **extra,
    )
    draft = (DFlash2DraftModel if extra else DFlashDraftModel)(cfg).eval()
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "candidate_selector" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.6)
        prompt = torch.tensor([0, 1, 2, 1])
        pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
        logits = target(input_ids=torch.cat([prompt.expand(len(pairs), -1), pairs], 1)).logits[:, -2:]
    return target, draft, logits[::vocab, 0], logits[:, 1].view(vocab, vocab, vocab)


@pytest.mark.compat
@pytest.mark.parametrize("kind", ["slots", "selector"])
def test_sampled_tree_acceptance_keeps_the_target_distribution(kind):
    """One tree cycle at T > 0, many times: the two tokens emitted after the anchor t1 (accepted tree tokens, a
    residual draw or the bonus) must follow the target's p(t2 | t1) p(t3 | t1, t2) (the chain's chi-square test).
    The root has several children, so acceptance after rejected siblings, residual draws and (DFlash2: top-2
    candidates of 4 tokens) tokens outside every candidate all occur."""
    vocab, temp, per_anchor = 4, 1.5, 600
    target, draft, after_t1, after_t1_t2 = _sampling_case(kind)
    p1, p2 = torch.softmax(after_t1.double() / temp, -1), torch.softmax(after_t1_t2.double() / temp, -1)
    gen = torch.Generator().manual_seed(0)
    hiddens = 0.2 * torch.randn(vocab, 3, 32, generator=gen)
    counts, expected, stats = Counter(), {}, Counter()
    for t1 in range(vocab):
        for t2, t3 in itertools.product(range(vocab), repeat=2):
            expected[(t1, t2, t3)] = per_anchor * float(p1[t1, t2] * p2[t1, t2, t3])
        with torch.no_grad():
            scores = draft_scores(draft, hiddens[t1], target.lm_head, t1)
        width = 2 if kind == "selector" else 4
        shape = build_tree(*scores.candidates(width), tree_nodes(4, 2, width))
        assert int((shape.parents == 0).sum()) >= 2  # siblings at the root
        for _ in range(per_anchor):
            tokens, q = scores.sample(shape, width, temp, gen)
            tree = type(shape)(tokens, shape.parents, shape.depth, shape.ancestors, shape.choice)
            rows = [after_t1[t1]] + [
                after_t1_t2[t1, t] if d == 1 else after_t1[t1] for t, d in zip(tokens, tree.depth[1:])
            ]
            out = accept_sampled(tree, q, torch.stack(rows) / temp, 2, gen)
            emitted = out.new_ids[:2]
            if len(emitted) < 2:  # t3 comes from the next cycle: p(. | t1, t2)
                emitted.append(int(torch.multinomial(p2[t1, emitted[0]].float(), 1, generator=gen)))
            counts[(t1, *emitted)] += 1
            stats[f"accepted_{out.k}"] += 1
            stats["not_first_child"] += int(out.k > 0 and out.path[1] != 1)
            stats["outside_candidates"] += int(q[0, emitted[0]] == 0)
    total = vocab * per_anchor
    assert stats["accepted_0"] > 0.05 * total and stats["accepted_2"] > 0.03 * total, stats
    assert stats["not_first_child"] > 0.02 * total, stats
    if kind == "selector":
        assert stats["outside_candidates"] > 0.02 * total, stats
    p_value, dof = chi_square_p_value(counts, expected)
    assert dof >= 20 and p_value > 1e-3, (p_value, dof, stats)
