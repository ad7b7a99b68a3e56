"""What the target's scores over a verified token tree decide (DESIGN section 9): its logits processors applied to
every node's row, the accepted root path and the token after it.

- Greedy (:func:`accept_greedy`): from the root, follow the child whose token is the target's argmax; the path's
  tokens are the target's argmax at the root and at each accepted node, the last one the bonus token. The argmax and
  the tree are read back to the host once and walked there, so the device runs what the chain's acceptance runs (an
  argmax and one concatenation), whatever the tree's shape; a path off the tree's chain adds its nodes' gather.
- Sampling (:func:`accept_sampled`): recursive rejection over siblings (SpecInfer's multi-candidate rule, its
  without-replacement form as in Recursive Speculative Decoding): at a node whose children were drawn without
  replacement from `q`, child `i` is accepted with probability `min(1, p_i(x_i) / q_i(x_i))`; on rejection
  `p_{i+1} = norm(max(p_i - q_i, 0))` and `q_{i+1}` is `q_i` without `x_i`; when every child is rejected (or at a
  leaf) the next token is drawn from what is left of `p`. Each step is a speculative sampling step of `p_i` from a
  draw of `q_i`, so the emitted token follows the target's `p`, as long as the tree's shape was fixed before its
  tokens were drawn (:meth:`SlotScores.sample`, :meth:`SelectorScores.sample`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList

from dflash_hf.generation.tree import DraftTree
from dflash_hf.generation.verify_rules import BEGIN_INDEX_PROCESSORS, ROW_WISE_PROCESSORS


@dataclass
class Accepted:
    """One cycle's outcome: `k` accepted draft tokens; `path` `[k+1]` the path's nodes (the root first) on the host;
    `new` `[k+1]` the new tokens (accepted ones, then the bonus or resampled one) on the device and `new_ids` on the
    host; `off_chain` the path's nodes on the device where the path leaves the tree's chain (None for nodes `0..k`:
    the rows of a chain's verify, nothing to gather)."""

    k: int
    path: list[int]
    new: torch.Tensor
    new_ids: list[int]
    off_chain: torch.Tensor | None = None

    @property
    def on_chain(self) -> bool:
        """Whether the path is nodes `0..k` (the chain's first `k` nodes)."""
        return self.off_chain is None


def _on_chain(path: list[int]) -> bool:
    return path == list(range(len(path)))


def tree_processed(
    processors: LogitsProcessorList, prefix: torch.Tensor, logits: torch.Tensor, tree: DraftTree
) -> torch.Tensor:
    """Scores `[N+1, V]` for the tree's logits (row n follows `prefix` `[1, L]` then node n's path): the target's
    processors in their order, each row seeing the ids before it, as `generate` applies them (float32). Row-wise
    processors run on every row at once; a begin-index one (Whisper's begin-suppressed tokens, which reads only the
    length of the ids) on the rows at its depth; any other runs row by row on each node's ids (read back once)."""
    scores = logits.float()
    ids: list[torch.Tensor] = []
    for proc in processors:
        if type(proc) in ROW_WISE_PROCESSORS:
            scores = proc(prefix, scores)
        elif type(proc) in BEGIN_INDEX_PROCESSORS:
            depth = proc.begin_index - prefix.shape[1]
            if 0 <= depth <= int(scores.shape[0]):
                length = prefix.new_zeros(1, depth)  # the processor reads the ids' length only
                masked = proc(torch.cat([prefix, length], dim=1), scores)
                scores = torch.where((tree.depth == depth)[:, None], masked, scores)
        else:
            if not ids:
                ids.extend(node_ids(prefix, tree))
            scores = torch.cat([proc(ids[n], scores[n : n + 1]) for n in range(scores.shape[0])])
    return scores


def node_ids(prefix: torch.Tensor, tree: DraftTree) -> list[torch.Tensor]:
    """Each node's ids `[1, L + depth]`: `prefix` then its path's tokens (the tree read back once)."""
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    paths: list[list[int]] = [[]]
    for parent, token in zip(parents, tokens):
        paths.append(paths[parent] + [token])
    return [torch.cat([prefix, prefix.new_tensor([path])], dim=1) for path in paths]


def accept_greedy(tree: DraftTree, scores: torch.Tensor, max_depth: int) -> Accepted:
    """The longest root path whose every node is the target's argmax after its parent, nodes deeper than
    `max_depth` excluded (past the decoder's positions). Two operators on the device (the argmax and one
    concatenation) and one read, as the chain's acceptance: the walk runs on the host over the tree read back with the
    argmax (siblings hold distinct tokens: at most one child of a node is its argmax). Off the chain, one more: the
    argmax at the path's nodes (the walk's `path`, copied to the device)."""
    target = scores.argmax(-1)  # [N+1]
    n = tree.nodes
    host = torch.cat([target, tree.tokens.to(target.dtype), tree.parents.to(target.dtype)]).tolist()
    argmax, tokens, parents = host[: n + 1], host[n + 1 : 2 * n + 1], host[2 * n + 1 :]
    path = [0]
    for node in range(1, n + 1):  # parents come before their children: one pass finds the path's next node
        if len(path) > max_depth:
            break
        if parents[node - 1] == path[-1] and tokens[node - 1] == argmax[path[-1]]:
            path.append(node)
    k = len(path) - 1
    new_ids = [argmax[node] for node in path]
    if _on_chain(path):
        return Accepted(k=k, path=path, new=target[: k + 1], new_ids=new_ids)
    nodes = torch.tensor(path, device=target.device)  # int64, as an index
    return Accepted(k=k, path=path, new=target[nodes], new_ids=new_ids, off_chain=nodes)


def accept_sampled(
    tree: DraftTree, q: torch.Tensor, scores: torch.Tensor, max_depth: int, generator: torch.Generator | None
) -> Accepted:
    """Recursive rejection over siblings (module docstring). `tree`: its nodes' tokens drawn from `q` `[N+1, V]`, the
    distribution each node's children were drawn from (`SlotScores.sample`, `SelectorScores.sample`); `scores`
    `[N+1, V]` the target's processed scores (temperature included)."""
    p_all = torch.softmax(scores.float(), dim=-1)
    parents, depth, drawn = tree.parents.tolist(), tree.depth.tolist(), tree.tokens.tolist()
    children: list[list[int]] = [[] for _ in depth]
    for n, parent in enumerate(parents, start=1):
        if depth[n] <= max_depth:
            children[parent].append(n)  # in rank order: the order of their draws
    node, path, new_ids = 0, [0], []
    while True:
        p, q_node, nxt = p_all[node], q[node].float(), None
        for child in children[node]:
            x = drawn[child - 1]
            ratio = p[x] / q_node[x].clamp(min=1e-20)
            if bool(torch.rand((), generator=generator, device=p.device) < ratio.clamp(max=1.0)):
                nxt = child
                break
            residual = (p - q_node).clamp(min=0)
            p = residual / residual.sum() if bool(residual.sum() > 0) else p
            q_node = q_node.index_fill(0, torch.tensor([x], device=q_node.device), 0.0)
            q_node = q_node / q_node.sum() if bool(q_node.sum() > 0) else q_node
        if nxt is None:
            new_ids.append(int(torch.multinomial(p, 1, generator=generator)))
            break
        node = nxt
        path.append(node)
        new_ids.append(drawn[node - 1])
    return Accepted(
        k=len(path) - 1,
        path=path,
        new=torch.tensor(new_ids, device=scores.device),
        new_ids=new_ids,
        off_chain=None if _on_chain(path) else torch.tensor(path, device=scores.device),
    )


__all__ = ["Accepted", "accept_greedy", "accept_sampled", "node_ids", "tree_processed"]
