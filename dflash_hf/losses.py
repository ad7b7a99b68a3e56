"""Decayed block cross-entropy and its metrics (DESIGN 3.7-3.8).

Losses are returned as *sums* (`Σ w·CE`) together with their denominators, so the trainer can
normalize over the global batch (all micro-batches and ranks) and the result does not depend on how
a batch is split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .blocks import Blocks


def _chunk_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    logits = F.linear(hidden, weight).float()  # [m, V]
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1)


def chunked_lm_head_ce(
    hidden: torch.Tensor,  # [M, H]
    lm_head_weight: torch.Tensor,  # [V, H] frozen
    labels: torch.Tensor,  # [M]
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token CE and argmax of `lm_head(hidden)` without keeping `[M, V]` logits alive: each chunk
    is recomputed in backward (activation checkpointing), so peak memory holds one chunk of logits."""
    ces, preds = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            ce, pred = checkpoint(_chunk_ce, h, lm_head_weight, y, use_reentrant=False)
        else:
            ce, pred = _chunk_ce(h, lm_head_weight, y)
        ces.append(ce)
        preds.append(pred)
    if not ces:
        return hidden.new_zeros(0, dtype=torch.float32), labels.new_zeros(0)
    return torch.cat(ces), torch.cat(preds)


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
) -> BlockLoss:
    """Decayed CE over slots 1..B-1 of every block; only valid slots are projected to the vocabulary."""
    slots = hidden[:, :, 1:]  # [b, N, B-1, H]
    sel = blocks.valid
    ce, pred = chunked_lm_head_ce(slots[sel], lm_head_weight, blocks.labels[sel], chunk_size)
    w = blocks.weights[sel]
    # `hidden.sum() * 0` keeps the graph connected when no slot is valid (a differentiable zero).
    loss_sum = (w * ce).sum() + hidden.sum() * 0.0
    correct = torch.zeros_like(sel)
    correct[sel] = pred == blocks.labels[sel]
    return BlockLoss(loss_sum=loss_sum, weight_sum=w.sum().detach(), correct=correct, blocks=blocks)


def acceptance_sum(correct: torch.Tensor, anchor_valid: torch.Tensor) -> torch.Tensor:
    """Σ over valid blocks of `Σ_k Π_{j<=k} correct_j` (τ_est = 1 + this / #blocks)."""
    run = torch.cumprod(correct.float(), dim=-1).sum(-1)  # [b, N]
    return (run * anchor_valid).sum()


@dataclass
class MetricSums:
    """Running sums of training / evaluation statistics; `reduce` turns them into logged metrics.

    Keeps float64 CPU scalars so that many steps can be added without precision loss.
    """

    prefix: str = ""
    values: dict[str, float] = field(default_factory=dict)
    slot_correct: torch.Tensor | None = None
    slot_count: torch.Tensor | None = None

    def add(self, name: str, value) -> None:
        self.values[name] = self.values.get(name, 0.0) + float(value)

    def add_slots(self, correct: torch.Tensor, valid: torch.Tensor) -> None:
        c = (correct & valid).flatten(0, -2).sum(0).double().cpu()
        n = valid.flatten(0, -2).sum(0).double().cpu()
        if self.slot_correct is None or self.slot_correct.shape != c.shape:
            self.slot_correct, self.slot_count = c, n
        else:
            self.slot_correct += c
            self.slot_count += n

    def add_block_loss(self, out: BlockLoss, tag: str = "") -> None:
        """Accumulate loss, accuracy and acceptance sums of one micro-batch (`tag` prefixes names)."""
        self.add(f"{tag}loss_sum", out.loss_sum.detach())
        self.add(f"{tag}weight_sum", out.weight_sum)
        self.add(f"{tag}accept_sum", acceptance_sum(out.correct, out.blocks.anchor_valid))
        self.add(f"{tag}blocks", out.blocks.anchor_valid.sum())
        if not tag:
            self.add_slots(out.correct, out.blocks.valid)

    def as_tensor(self, device) -> tuple[list[str], torch.Tensor]:
        """Flatten for one all-reduce: names and a float64 vector (slot stats appended)."""
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
        """Metrics: loss, tau_est, per-slot accuracy, plus any extra sums divided as documented."""
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
            if name.startswith("count_"):
                out[f"{p}{name[len('count_'):]}"] = value
            elif name.startswith("mean_") and v.get("steps", 0) > 0:
                out[f"{p}{name[len('mean_'):]}"] = value / v["steps"]
        return out
