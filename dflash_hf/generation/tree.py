"""Token trees from one draft forward (DESIGN section 9), built on the device with fixed shapes.

One draft forward gives each slot `1..D` (`D = block_size - 1`) a distribution over the vocabulary. A tree node is a
token path from the root (the anchor, the last committed token); the children of a node at depth `d` are candidates
for slot `d + 1`:

- DFlash drafts condition every slot on the mask token, not on the token before it: every node at depth `d` has the
  same candidates, the slot's `width` most likely tokens (its argmax first), scored by `log q_{d+1}` over the whole
  vocabulary (:class:`SlotScores`);
- DFlash2 drafts rank the successors of each predecessor with their candidate selector: the children of a node are
  the selector's top-k candidates of the next slot, scored by the selector's conditional distribution given the
  node's own token (`softmax` of its `transition_table` row, the distribution its sampled walk draws from;
  :class:`SelectorScores`).

:func:`build_tree` grows the tree best-first by path probability (the product of the `q` along the path) up to
`nodes` nodes, the draft's own greedy proposal (its chain) first: a tree of at least `D` nodes holds the chain, so it
never accepts fewer tokens than the chain from the same draft forward, and a tree of `D` nodes is the chain. It is a
beam of width `nodes` over the depths (the best `nodes` paths of every depth hold every path of the best tree) and one
top-k over the beams, a fixed number of operators without a read to the host (it runs inside the draft's CUDA graph).
Nodes come in decreasing path score, the chain first, so a parent always precedes its children and the chain is
nodes `1..D`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

LOG_FLOOR = -1e3  # log-probabilities below count as this: path scores stay finite
DEPTH_TIE = 1e-6  # a child ranks strictly after its parent even at probability 1
CHAIN_BOOST = 1e6  # the draft's greedy chain ranks before every other path


@dataclass
class DraftTree:
    """A token tree of `N` nodes below its root (node 0, the anchor). `tokens` `[N]` of nodes `1..N`; `parents` `[N]`
    their parent's node index; `depth` `[N+1]` (the root's 0); `ancestors` `[N+1, N+1]` bool, row `n` the ancestors
    of node `n` and `n` itself (the root included); `choice` `[N]` the node's candidate index in its slot;
    `verify_inputs` (made by the fixed-shape draft step, else None) what a fixed-shape verify of the tree reads, in one
    tensor (:func:`verify_inputs`)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor
    choice: torch.Tensor
    verify_inputs: torch.Tensor | None = None

    @property
    def nodes(self) -> int:
        return self.tokens.shape[0]

    def as_tuple(self) -> tuple[torch.Tensor | None, ...]:
        return self.tokens, self.parents, self.depth, self.ancestors, self.choice, self.verify_inputs

    def sibling_rank(self) -> torch.Tensor:
        """`[N]`: how many siblings come before each node (nodes come in decreasing path score)."""
        order = torch.arange(self.nodes, device=self.parents.device)
        same = self.parents[None, :] == self.parents[:, None]
        return (same & (order[None, :] < order[:, None])).sum(-1)


def candidate_width(draft, budget: int, vocab_size: int) -> int:
    """Candidates per slot: a DFlash2 draft's selector top-k; otherwise as many as the tree may hold children of one
    node (`budget`, at most the vocabulary)."""
    selector = getattr(draft, "candidate_selector", None)
    return selector.top_k if selector is not None else min(budget, vocab_size)


def tree_nodes(budget: int, depth: int, width: int) -> int:
    """The nodes a tree of `budget` holds: fewer only where `depth` slots of `width` candidates make fewer paths."""
    return min(budget, sum(min(budget, width**d) for d in range(1, depth + 1)))


class SlotScores:
    """A DFlash draft's slot distributions: `logits` `[D, V]` of slots `1..D`, one distribution per slot."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits.float()

    def candidates(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(candidates [D, K], logq [D, 1, K], greedy [D, 1])`: each slot's argmax, then its next most likely tokens
        (the argmax is the chain's token whatever the ties), their log-probabilities, and the chain's index (0)."""
        best = self.logits.argmax(-1, keepdim=True)  # [D, 1]
        rest = self.logits.scatter(-1, best, float("-inf")).topk(width - 1, dim=-1).indices
        candidates = torch.cat([best, rest], dim=-1)
        logq = torch.log_softmax(self.logits, dim=-1).gather(-1, candidates)[:, None]
        return candidates, logq, torch.zeros_like(best)

    def sample(self, tree: DraftTree, width: int, temperature: float, generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `[N]` of the tree's nodes drawn by rank, and `[N+1, V]` the distribution each node's children were
        drawn from (a leaf's row unused): each slot draws `width` tokens without replacement (Gumbel top-k), a node
        takes the draw of its rank among its siblings (all parents at one depth share the slot's draws: the slot's
        distribution does not depend on the parent)."""
        scaled = self.logits / temperature
        draws = (scaled + _gumbel(scaled.shape, scaled.device, generator)).topk(width, dim=-1).indices  # [D, K]
        tokens = draws[tree.depth[1:] - 1, tree.sibling_rank()]
        return tokens, torch.softmax(scaled, dim=-1)[tree.depth.clamp(max=scaled.shape[0] - 1)]


class SelectorScores:
    """A DFlash2 draft's selector scores: `candidates` `[D, k]`, the top-k of each slot's logits, and `table`
    `[D, k, k]` (`DFlash2CandidateSelector.transition_table`), entry `[s, i, j]` candidate j of slot s after candidate
    i of slot s-1 (slot 0's rows: the anchor's)."""

    def __init__(self, candidates: torch.Tensor, table: torch.Tensor, vocab_size: int):
        self.cands, self.table, self.vocab_size = candidates, table.float(), vocab_size

    def candidates(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(candidates [D, k], logq [D, k, k], greedy [D, k])`: the greedy child of a predecessor is the table's
        argmax (as the greedy walk takes it)."""
        return self.cands, torch.log_softmax(self.table, dim=-1), self.table.argmax(-1)

    def sample(self, tree: DraftTree, width: int, temperature: float, generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `[N]` drawn by rank, depth by depth, and `[N+1, V]` each node's children's distribution (zero
        outside the next slot's candidates): the children of a node are draws without replacement (Gumbel top-k) from
        the selector's distribution given the node's own drawn token."""
        n, dev = tree.nodes, self.table.device
        parents = torch.cat([tree.parents.new_zeros(1), tree.parents])  # [N+1], the root its own parent
        rank = torch.cat([tree.parents.new_zeros(1), tree.sibling_rank()])
        scaled = self.table / temperature
        noise = _gumbel((n + 1, scaled.shape[-1]), dev, generator)  # one draw order per parent
        choice = torch.zeros(n + 1, dtype=torch.long, device=dev)  # candidate index in its slot (the root: row 0)
        for d in range(1, scaled.shape[0] + 1):
            rows = scaled[d - 1][choice[parents]] + noise[parents]  # [N+1, k]: each node's parent's draw keys
            drawn = rows.argsort(-1, descending=True).gather(1, rank[:, None])[:, 0]
            choice = torch.where(tree.depth == d, drawn, choice)
        tokens = self.cands[tree.depth[1:] - 1, choice[1:]]
        slot = tree.depth.clamp(max=scaled.shape[0] - 1)  # the slot of each node's children
        probs = torch.softmax(scaled[slot, choice], dim=-1)  # [N+1, k]
        dist = probs.new_zeros(n + 1, self.vocab_size).scatter(1, self.cands[slot], probs)
        return tokens, dist


def draft_scores(draft, hidden: torch.Tensor, lm_head: torch.nn.Module, anchor) -> SlotScores | SelectorScores:
    """The slot distributions of one draft forward (`hidden` `[B, H]`, its final-normed block): a DFlash2 draft's
    selector table, otherwise the slots' logits. `anchor`: the root's token (a host int or a 0-d device tensor)."""
    custom = getattr(draft, "tree_scores", None)  # a variant's own (as `propose_block`)
    if custom is not None:
        return custom(hidden, lm_head, anchor)
    logits = lm_head(hidden[1:]).float()
    selector = getattr(draft, "candidate_selector", None)
    if selector is None:
        return SlotScores(logits)
    unary, candidates = logits.topk(selector.top_k, dim=-1)
    return SelectorScores(
        candidates, selector.transition_table(hidden[1:], unary, candidates, anchor), logits.shape[-1]
    )


def _gumbel(shape, device, generator) -> torch.Tensor:
    uniform = torch.rand(shape, device=device, generator=generator).clamp(1e-20, 1.0 - 1e-7)
    return -torch.log(-torch.log(uniform))


def build_tree(candidates: torch.Tensor, logq: torch.Tensor, greedy: torch.Tensor, nodes: int) -> DraftTree:
    """The best-first tree of `nodes` nodes (module docstring) from `candidates` `[D, K]`, `logq` `[D, R, K]` (R = 1:
    every predecessor alike; R = K: row i after candidate i of the previous slot, the root's children in row 0) and
    `greedy` `[D, R]` (the chain's candidate after each predecessor). `nodes` at most `tree_nodes(...)`."""
    depth, width = candidates.shape
    dev = candidates.device
    lq = logq.double().clamp(LOG_FLOOR, 0.0)
    entry = torch.arange(nodes, device=dev)
    score = torch.where(entry == 0, 0.0, float("-inf")).double()  # the beam at depth 0: the root alone
    chain, choice = entry == 0, torch.zeros_like(entry)
    on_greedy = torch.arange(width, device=dev) == greedy[:, :, None]  # [D, R, K]: the chain's candidate
    shared = lq.shape[1] == 1  # every predecessor alike: slot d's one row, broadcast over the beam
    keys, parents, choices = [], [], []
    for d in range(depth):
        row_q, row_greedy = (lq[d, :1], on_greedy[d, :1]) if shared else (lq[d, choice], on_greedy[d, choice])
        child = score[:, None] + row_q  # [nodes, K]; -inf below an empty beam entry
        child_chain = chain[:, None] & row_greedy
        key = child + CHAIN_BOOST * child_chain - DEPTH_TIE * (d + 1)
        top, index = key.flatten().topk(nodes)
        score, chain = child.flatten()[index], child_chain.flatten()[index]
        choice = index % width
        keys.append(top)
        parents.append(index // width)
        choices.append(choice)
    keys, parents, choices = torch.stack(keys), torch.stack(parents), torch.stack(choices)  # [D, nodes]
    picked = keys.flatten().topk(nodes).indices  # pool entries, decreasing key: parents before children
    level, slot = picked // nodes, picked % nodes
    node_of = torch.zeros(depth * nodes, dtype=torch.long, device=dev).scatter(0, picked, entry + 1)
    parent_entry = ((level - 1) * nodes + parents[level, slot]).clamp(min=0)
    parent = torch.where(level == 0, 0, node_of[parent_entry])
    node_choice = choices[level, slot]
    tokens = candidates[level, node_choice]
    return DraftTree(
        tokens=tokens,
        parents=parent,
        depth=torch.cat([entry.new_zeros(1), level + 1]),
        ancestors=_ancestors(parent, depth),
        choice=node_choice,
    )


def _ancestors(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """`[N+1, N+1]` bool: each node's ancestors and itself, by doubling the parent relation (a path has at most
    `depth` edges)."""
    n = parents.shape[0] + 1
    reach = torch.eye(n, device=parents.device)
    reach = reach.index_put((torch.arange(1, n, device=parents.device), parents), reach.new_ones(n - 1))
    for _ in range(math.ceil(math.log2(max(depth, 1)))):
        reach = ((reach @ reach) > 0).to(reach.dtype)
    return reach > 0


def verify_inputs(anchor: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """`[N+1, N+3]` long: the verify's ids (column 0: `anchor`, the root's token, then the nodes'), the nodes'
    depths (column 1) and ancestors (columns 2..), so that a fixed-shape verify takes them in one copy."""
    ids = torch.cat([anchor.reshape(1).to(tree.tokens.dtype), tree.tokens])
    return torch.cat([ids[:, None], tree.depth[:, None], tree.ancestors.long()], dim=1)


@dataclass(frozen=True)
class TreeHead:
    """The draft step's head for tree decoding (greedy): the tree of `nodes` nodes over `width` candidates a slot,
    with its verify's inputs, as a tuple of tensors (`DraftTree.as_tuple`; a fixed-shape step returns it from its
    CUDA graph). `anchor`: the root's token on the device."""

    nodes: int
    width: int

    def __call__(self, draft, hidden: torch.Tensor, lm_head: torch.nn.Module, anchor) -> tuple[torch.Tensor, ...]:
        scores = draft_scores(draft, hidden, lm_head, anchor)
        tree = build_tree(*scores.candidates(self.width), self.nodes)
        return dataclasses.replace(tree, verify_inputs=verify_inputs(anchor, tree)).as_tuple()


__all__ = [
    "DraftTree",
    "SelectorScores",
    "SlotScores",
    "TreeHead",
    "build_tree",
    "candidate_width",
    "draft_scores",
    "tree_nodes",
    "verify_inputs",
]
