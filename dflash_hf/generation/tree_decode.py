"""One speculative cycle with tree verification (DESIGN section 9), for the draft/verify loop of
:mod:`dflash_hf.generation.speculative` (`tree_budget`): the token tree of the draft's block
(:mod:`~dflash_hf.generation.tree`), its verify in one target forward (:mod:`~dflash_hf.generation.tree_verify`) and
what the target's scores accept (:mod:`~dflash_hf.generation.tree_accept`). Greedy, a cycle reads the device once
(the acceptance), as the chain's does; the tree is built on the device, inside the draft's CUDA graph where the draft
step runs as one."""

from __future__ import annotations

import dataclasses

import torch

from dflash_hf.generation.decode_state import crop_cache
from dflash_hf.generation.target_cache import check_block_cached
from dflash_hf.generation.tree import (
    DraftTree,
    TreeHead,
    build_tree,
    candidate_width,
    draft_scores,
    tree_nodes,
    verify_inputs,
)
from dflash_hf.generation.tree_accept import Accepted, accept_greedy, accept_sampled, tree_processed
from dflash_hf.generation.tree_verify import (
    FixedTreeVerifyStep,
    cache_tensors,
    check_tree_target,
    keep_path,
    verify_tree,
)


def check_tree_budget(tree_budget) -> None:
    """`tree_budget`: None (chain verification) or a positive int (nodes of the tree below its root)."""
    if tree_budget is not None and (isinstance(tree_budget, bool) or not isinstance(tree_budget, int)):
        raise ValueError(f"tree_budget must be None (chain) or a positive int, got {tree_budget!r}")
    if tree_budget is not None and tree_budget < 1:
        raise ValueError(f"tree_budget must be >= 1 (nodes of the tree below its root), got {tree_budget}")


class TreeDecode:
    """A decode's tree verification over trees of `budget` nodes (fewer where the block's slots make fewer paths).
    Made before the prompt's forward: a target whose decoder cannot take the tree's mask is refused there."""

    step_kind = FixedTreeVerifyStep  # the fixed-shape verify's class

    def __init__(self, draft, ft, budget: int, *, sample: bool, draft_temperature: float):
        check_tree_target(ft)  # `budget` was checked with the decode's options (`DecodeOptions`)
        self.ft, self.sample, self.temperature = ft, sample, draft_temperature
        self.depth = draft.config.block_size - 1
        self.width = candidate_width(draft, budget, ft.vocab_size)
        self.nodes = tree_nodes(budget, self.depth, self.width)
        self.head = TreeHead(self.nodes, self.width)  # the fixed-shape draft step's output (greedy)

    def tree(self, draft, drafted, anchor, generator) -> tuple[DraftTree, torch.Tensor | None]:
        """The cycle's tree from the draft step's output (`TreeHead`'s tuple) or the eager draft's hidden block
        `[B, H]`, and (sampling) the distribution each node's children were drawn from."""
        if isinstance(drafted, tuple):
            return DraftTree(*drafted), None
        scores = draft_scores(draft, drafted.to(self.ft.dtype), self.ft.lm_head, anchor)
        tree = build_tree(*scores.candidates(self.width), self.nodes)
        if not self.sample:
            return tree, None
        tokens, q = scores.sample(tree, self.width, self.temperature, generator)
        return dataclasses.replace(tree, tokens=tokens), q

    def cycle(
        self,
        verifier,
        fixed: FixedTreeVerifyStep | None,
        processors,
        seq: torch.Tensor,
        a: int,
        max_depth: int,
        tree: DraftTree,
        q: torch.Tensor | None,
        generator,
    ) -> tuple[Accepted, torch.Tensor, torch.Tensor]:
        """Verify `tree` (root: `seq`'s last token, at decoder row `a`; nodes deeper than `max_depth` are past the
        decoder's positions: never accepted), accept, and keep the path in the target's cache. Returns the outcome,
        the scores each new token was chosen from `[k+1, V]` and the path's taps `[1, k+1, T*H]`."""
        if fixed is None:
            ids = torch.cat([seq[:, -1:], tree.tokens[None].to(seq.dtype)], dim=1)
            # nodes are at most `self.depth` deep: capped only where the decoder's positions end within the block
            depth = tree.depth if max_depth >= self.depth else tree.depth.clamp(max=max_depth)
            logits, feats = verify_tree(verifier, ids, depth, tree.ancestors, a)
            check_block_cached(verifier.cache, a + ids.shape[1], self.ft.model)
        else:  # inputs made by the fixed-shape draft step; blocks within the decoder's positions (no depth cap)
            inputs = tree.verify_inputs if tree.verify_inputs is not None else verify_inputs(seq[0, -1], tree)
            logits, feats = fixed.verify_tree_inputs(self.ft, inputs, a)
            verifier.forwards += 1
        scores = tree_processed(processors, seq, logits, tree)
        if self.sample:
            accepted = accept_sampled(tree, q, scores, max_depth, generator)
        else:
            accepted = accept_greedy(tree, scores, max_depth)
        k = accepted.k
        if not accepted.on_chain:  # gather the path's rows
            keep_path(cache_tensors(verifier.cache) if fixed is None else fixed.key_values(), a, accepted.off_chain)
        if fixed is None:  # fixed buffers: the next tree overwrites the rows past the path
            crop_cache(verifier.cache, a + k + 1)
        if accepted.on_chain:  # the path's rows are the first ones, as a chain's
            return accepted, scores[: k + 1], feats[:, : k + 1]
        return accepted, scores.index_select(0, accepted.off_chain), feats.index_select(1, accepted.off_chain)


__all__ = ["TreeDecode", "check_tree_budget"]
