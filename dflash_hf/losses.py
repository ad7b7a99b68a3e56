"""Decayed block cross-entropy and its metrics (DESIGN 3.7-3.8).

Losses are returned as *sums* (`Σ w·CE`) together with their denominators, so the trainer can
normalize over the global batch (all micro-batches and ranks) and the result does not depend on how
a batch is split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .blocks import Blocks


def map_chunks(fn: Callable[..., tuple[torch.Tensor, ...]], rows: Sequence[torch.Tensor], chunk_size: int):
    """`fn` over row chunks of `rows` (each `[M, ...]`), outputs concatenated. A chunk whose first input
    needs grad is recomputed in backward (activation checkpointing), so peak memory holds one chunk of
    logits. `M == 0` runs `fn` once on the empty rows (outputs keep their dtypes, the graph stays connected)."""
    outs = []
    for start in range(0, max(rows[0].shape[0], 1), chunk_size):
        part = [r[start : start + chunk_size] for r in rows]
        if torch.is_grad_enabled() and part[0].requires_grad:
            outs.append(checkpoint(fn, *part, use_reentrant=False))
        else:
            outs.append(fn(*part))
    return tuple(torch.cat(o) for o in zip(*outs))


def _ce_and_logit_grad(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, need_grad: bool):
    """Per-row CE and argmax of one chunk of logits (float32 math), and `d(Σ w·CE)/d logits` in the logits'
    dtype when asked."""
    dtype = logits.dtype
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    ce = lse - logits.gather(1, labels[:, None]).squeeze(1)
    pred = logits.argmax(-1)
    if not need_grad:
        return ce, pred, None
    # softmax - onehot as one pointwise expression (an in-place scatter of -1 would make the compiled kernel
    # materialize the float32 softmax of the whole chunk before it)
    onehot = torch.arange(logits.shape[-1], device=logits.device)[None, :] == labels[:, None]
    grad = (torch.exp(logits - lse[:, None]) - onehot.float()) * weights[:, None]
    return ce, pred, grad.to(dtype)


_compiled_ce_grad = None


def _ce_grad(logits, labels, weights, need_grad):
    """`_ce_and_logit_grad`, compiled on accelerators (one fused pass over each chunk's logits)."""
    global _compiled_ce_grad
    if logits.device.type == "cpu":
        return _ce_and_logit_grad(logits, labels, weights, need_grad)
    if _compiled_ce_grad is None:
        # default dynamism: the row count becomes symbolic once chunks of two sizes were seen; the
        # vocabulary stays static, so the reduction over it is specialized
        _compiled_ce_grad = torch.compile(_ce_and_logit_grad)
    return _compiled_ce_grad(logits, labels, weights, need_grad)


class _LinearCrossEntropy(torch.autograd.Function):
    """`Σ w·CE(hidden @ Wᵀ, labels)` chunk-wise, with `d/d hidden` computed in the forward pass: each chunk's
    logits are made once (checkpointed chunks would make them twice) and never outlive their chunk; backward
    only scales the stored `[M, H]` gradient. W (the frozen lm_head) gets no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_size):
        need_grad = ctx.needs_input_grad[0]
        loss = hidden.new_zeros((), dtype=torch.float32)
        pred = torch.empty_like(labels)
        grad = torch.empty_like(hidden) if need_grad else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = F.linear(hidden[rows], weight)
            ce, pred[rows], g = _ce_grad(logits, labels[rows], weights[rows], need_grad)
            loss = loss + (weights[rows] * ce).sum()
            if need_grad:
                grad[rows] = g @ weight
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(pred)
        return loss, pred

    @staticmethod
    def backward(ctx, grad_loss, grad_pred):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None


def fused_lm_head_ce(
    hidden: torch.Tensor,  # [M, H]
    lm_head_weight: torch.Tensor,  # [V, H] frozen
    labels: torch.Tensor,  # [M]
    weights: torch.Tensor,  # [M] slot weights (no grad)
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(Σ w·CE, argmax)` of `lm_head(hidden)`, `chunk_size` rows of `[M, V]` logits at a time."""
    if chunk_size <= 0:
        raise ValueError(f"ce_chunk_size must be > 0, got {chunk_size}")
    return _LinearCrossEntropy.apply(hidden, lm_head_weight, labels, weights.float(), chunk_size)


@dataclass
class BlockLoss:
    """Sums over one micro-batch. `loss_sum` is differentiable; the rest are detached statistics."""

    loss_sum: torch.Tensor  # Σ w·CE
    weight_sum: torch.Tensor  # Σ w
    correct: torch.Tensor  # [b, N, B-1] bool, argmax == label on valid slots
    blocks: Blocks


def block_loss(
    hidden: torch.Tensor,  # [b, N, B, H] final-normed draft hidden of every slot
    blocks: Blocks,
    lm_head_weight: torch.Tensor,
    chunk_size: int = 1024,
    fused: bool = True,
) -> BlockLoss:
    """Decayed CE over slots 1..B-1 of every block; only valid slots are projected to the vocabulary.
    `fused`: `fused_lm_head_ce`; else dense per-chunk logits, recomputed in backward (`map_chunks`)."""
    valid = ValidSlots.of(hidden, blocks)
    if fused:
        ce_sum, pred = fused_lm_head_ce(valid.hidden, lm_head_weight, valid.labels, valid.weights, chunk_size)
    else:
        ce, pred = map_chunks(partial(_chunk_ce, weight=lm_head_weight), (valid.hidden, valid.labels), chunk_size)
        ce_sum = (valid.weights * ce).sum()
    # `hidden.sum() * 0` keeps the graph connected when no slot is valid (a differentiable zero).
    loss_sum = ce_sum + hidden.sum() * 0.0
    correct = valid.scatter(pred == valid.labels)
    return BlockLoss(loss_sum=loss_sum, weight_sum=valid.weights.sum().detach(), correct=correct, blocks=blocks)


@dataclass
class ValidSlots:
    """The valid slots of a micro-batch as flat rows, selected by index (`Blocks.flat_valid_index`): with the
    indices planned on the CPU, neither the selection nor the scatter back synchronizes with the device."""

    index: torch.Tensor  # [M] flat indices into [b, N, B-1]
    hidden: torch.Tensor  # [M, H] draft hidden of those slots
    labels: torch.Tensor  # [M]
    weights: torch.Tensor  # [M]
    shape: torch.Size  # [b, N, B-1]

    @classmethod
    def of(cls, hidden: torch.Tensor, blocks: Blocks) -> ValidSlots:
        """`hidden`: `[b, N, B, H]`; slot k >= 1 of block q is row `q*B + k` of the flattened hidden."""
        index = blocks.flat_valid_index().to(hidden.device, non_blocking=True)
        per_block = blocks.block_size - 1
        rows = index + index // per_block + 1
        return cls(
            index=index,
            hidden=hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows),
            labels=blocks.labels.flatten().index_select(0, index),
            weights=blocks.weights.flatten().index_select(0, index),
            shape=blocks.valid.shape,
        )

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """`[M]` values back to `[b, N, B-1]`, zero (False) on invalid slots."""
        out = values.new_zeros(self.shape.numel())
        return out.index_copy(0, self.index, values).view(self.shape)


def _chunk_ce(hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor):
    """CE and argmax of one chunk of dense logits `hidden @ weightᵀ` (`[m, V]`, float32 math)."""
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1)


def _chunk_dflash2(
    hidden: torch.Tensor,  # [m, H]
    labels: torch.Tensor,  # [m]
    predecessors: torch.Tensor,  # [m] teacher-forced previous token
    weight: torch.Tensor,  # [V, H]
    selector: nn.Module,  # DFlash2CandidateSelector
):
    """Base CE and argmax, plus the selector CE over the top-k candidates of the same dense logits."""
    logits = F.linear(hidden, weight).float()  # [m, V]
    ce = F.cross_entropy(logits, labels, reduction="none")  # [m]
    unary, candidates = logits.topk(selector.top_k, dim=-1)  # [m, k]
    scores = selector(hidden, unary, candidates, predecessors)  # [m, k]
    is_label = candidates == labels[:, None]  # [m, k], at most one True per row
    hit = is_label.any(-1)  # [m] true token among the candidates
    sel_ce = torch.where(hit, torch.logsumexp(scores, -1) - (scores * is_label).sum(-1), 0.0)
    sel_pred = candidates.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1)
    return ce, logits.argmax(-1), sel_ce, sel_pred, hit


@dataclass
class DFlash2BlockLoss(BlockLoss):
    """Base sums (the inherited fields) plus the selector's, each with its own denominator."""

    selector: BlockLoss  # Σ w·selector CE; weight_sum = Σ w over slots whose label is a candidate;
    # correct = selector path's argmax (teacher-forced predecessor) equals the label
    candidate_hits: torch.Tensor  # [b, N, B-1] bool: label among the top-k candidates (valid slots)


def dflash2_block_loss(
    hidden: torch.Tensor,  # [b, N, B, H] final-normed draft hidden of every slot
    blocks: Blocks,
    lm_head_weight: torch.Tensor,  # [V, H] frozen
    selector: nn.Module,  # the draft's DFlash2CandidateSelector
    chunk_size: int = 1024,
) -> DFlash2BlockLoss:
    """DESIGN 4 losses, chunk-wise (one chunk of `[m, V]` logits alive, recomputed in backward):
    base = decayed CE of the dense logits (exactly `block_loss`); selector = k-way CE over
    `S(a, b) = U(b) + <A[a] * H(h), B[b]>` for the top-k candidates b with the teacher-forced
    predecessor a, only on slots whose label is a candidate, with the same decay weights."""
    if blocks.predecessors is None:
        raise ValueError("DFlash2 loss needs Blocks.predecessors; build the blocks with blocks.build_blocks")
    valid = ValidSlots.of(hidden, blocks)
    labels, w, scatter = valid.labels, valid.weights, valid.scatter
    ce, pred, sel_ce, sel_pred, hit = map_chunks(
        partial(_chunk_dflash2, weight=lm_head_weight, selector=selector),
        (valid.hidden, labels, blocks.predecessors.flatten().index_select(0, valid.index)),
        chunk_size,
    )
    zero = hidden.sum() * 0.0  # keeps the graph connected when no slot is valid
    return DFlash2BlockLoss(
        loss_sum=(w * ce).sum() + zero,
        weight_sum=w.sum().detach(),
        correct=scatter(pred == labels),
        blocks=blocks,
        selector=BlockLoss(
            loss_sum=(w * sel_ce).sum() + zero,
            weight_sum=(w * hit).sum().detach(),
            correct=scatter(sel_pred == labels),
            blocks=blocks,
        ),
        candidate_hits=scatter(hit),
    )


def acceptance_sum(correct: torch.Tensor, anchor_valid: torch.Tensor) -> torch.Tensor:
    """Σ over valid blocks of `Σ_k Π_{j<=k} correct_j` (τ_est = 1 + this / #blocks)."""
    run = torch.cumprod(correct.float(), dim=-1).sum(-1)  # [b, N]
    return (run * anchor_valid).sum()


@dataclass
class MetricSums:
    """Running sums of training / evaluation statistics; `reduce` turns them into logged metrics.

    Sums are float64. Tensor values stay on their device until `settle` (called by `reduce` and
    `as_tensor`, i.e. at logging time), so adding a micro-batch's statistics never waits for the device.
    """

    prefix: str = ""
    values: dict[str, float | torch.Tensor] = field(default_factory=dict)
    slot_correct: torch.Tensor | None = None
    slot_count: torch.Tensor | None = None

    def add(self, name: str, value: float | torch.Tensor) -> None:
        value = value.detach().double() if torch.is_tensor(value) else float(value)
        self.values[name] = self.values.get(name, 0.0) + value

    def settle(self) -> None:
        """Turn device sums into Python floats and CPU slot sums (one wait for the device)."""
        self.values = {n: float(v) for n, v in self.values.items()}
        if self.slot_correct is not None:
            self.slot_correct, self.slot_count = self.slot_correct.cpu(), self.slot_count.cpu()

    def add_slots(self, correct: torch.Tensor, valid: torch.Tensor) -> None:
        c = (correct & valid).flatten(0, -2).sum(0).double()
        n = valid.flatten(0, -2).sum(0).double()
        if self.slot_correct is None or self.slot_correct.shape != c.shape:
            self.slot_correct, self.slot_count = c, n
        else:
            self.slot_correct = self.slot_correct.to(c.device) + c
            self.slot_count = self.slot_count.to(n.device) + n

    def add_block_loss(self, out: BlockLoss, tag: str = "") -> None:
        """Accumulate loss, accuracy and acceptance sums of one micro-batch (`tag` prefixes names)."""
        self.add(f"{tag}loss_sum", out.loss_sum.detach())
        self.add(f"{tag}weight_sum", out.weight_sum)
        self.add(f"{tag}accept_sum", acceptance_sum(out.correct, out.blocks.anchor_valid))
        self.add(f"{tag}blocks", out.blocks.anchor_valid.sum())
        if not tag:
            self.add_slots(out.correct, out.blocks.valid)
        if isinstance(out, DFlash2BlockLoss):
            # selector_loss, selector_tau_est; selector_accuracy and candidate_recall per valid slot
            self.add_block_loss(out.selector, tag=f"{tag}selector_")
            valid = out.blocks.valid.sum()
            self.add(f"num_{tag}selector_accuracy", (out.selector.correct & out.blocks.valid).sum())
            self.add(f"den_{tag}selector_accuracy", valid)
            self.add(f"num_{tag}candidate_recall", out.candidate_hits.sum())
            self.add(f"den_{tag}candidate_recall", valid)

    def as_tensor(self, device) -> tuple[list[str], torch.Tensor]:
        """Flatten for one all-reduce: names and a float64 vector (slot stats appended)."""
        self.settle()
        names = sorted(self.values)
        vec = [self.values[n] for n in names]
        if self.slot_correct is not None:
            vec += self.slot_correct.tolist() + self.slot_count.tolist()
        return names, torch.tensor(vec, dtype=torch.float64, device=device)

    def load_tensor(self, names: list[str], vec: torch.Tensor) -> None:
        vec = vec.double().cpu()
        self.values = {n: float(v) for n, v in zip(names, vec[: len(names)])}
        rest = vec[len(names) :]
        if len(rest):
            half = len(rest) // 2
            self.slot_correct, self.slot_count = rest[:half].clone(), rest[half:].clone()

    def reduce(self) -> dict[str, float]:
        """Metrics: `{tag}loss` and `{tag}tau_est` per tag, per-slot accuracy, and each ratio `num_X / den_X`."""
        self.settle()
        v, p = self.values, self.prefix
        out: dict[str, float] = {}
        tags = sorted({n[: -len("loss_sum")] for n in v if n.endswith("loss_sum")})
        for tag in tags:
            ws = v.get(f"{tag}weight_sum", 0.0)
            out[f"{p}{tag}loss"] = v[f"{tag}loss_sum"] / ws if ws > 0 else 0.0
            nb = v.get(f"{tag}blocks", 0.0)
            if f"{tag}accept_sum" in v:
                out[f"{p}{tag}tau_est"] = 1.0 + (v[f"{tag}accept_sum"] / nb if nb > 0 else 0.0)
        if self.slot_correct is not None:
            acc = self.slot_correct / self.slot_count.clamp(min=1)
            out[f"{p}accuracy"] = float(self.slot_correct.sum() / self.slot_count.sum().clamp(min=1))
            for k, a in enumerate(acc.tolist(), start=1):
                out[f"{p}acc_slot{k}"] = a
        for name, value in v.items():
            if name.startswith("num_"):  # ratio num_X / den_X
                den = v.get(f"den_{name[len('num_'):]}", 0.0)
                out[f"{p}{name[len('num_'):]}"] = value / den if den > 0 else 0.0
        return out
