"""Training metrics: acceptance sums and the running `MetricSums` a Trainer logs (docs/EVALUATION.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_hf.objective.losses.common import BlockLoss
from dflash_hf.objective.losses.selector import DFlash2BlockLoss


def acceptance_sum(correct: torch.Tensor, anchor_valid: torch.Tensor) -> torch.Tensor:
    """Σ over valid blocks of `Σ_k Π_{j<=k} correct_j` (τ_est = 1 + this / #blocks)."""
    run = torch.cumprod(correct.float(), dim=-1).sum(-1)  # [b, N]
    return (run * anchor_valid).sum()


def acceptance_lengths(correct: torch.Tensor) -> torch.Tensor:
    """`[b, N]` acceptance length of each block: 1 + the run of correct slots from slot 1 (`correct` `[b, N, B-1]`)."""
    return 1 + torch.cumprod(correct.long(), dim=-1).sum(-1)


def decode_walk(
    anchors: torch.Tensor,  # [b, N], -1 = unused
    lengths: torch.Tensor,  # [b, N] `acceptance_lengths` of the blocks at `anchors`
    loss_mask: torch.Tensor,  # [b, S]
    doc_ids: torch.Tensor,  # [b, S], -1 on padding
) -> tuple[int, int]:
    """`(tokens, cycles)` of the decodes the blocks describe. A speculative decode of a response gets its first token
    from the prompt's forward, then anchors each cycle at the last token it has: the first cycle at the response's
    first token, the next one `kept` tokens further, `kept` the cycle's acceptance length, cut at the response's
    last token (decoding stops at it). Walked over every supervised span (a response) whose anchors are all among
    `anchors`; a span that reaches an anchor not drawn is left out. Real tau is tokens / cycles: an average over
    cycles, where tau_est averages over positions (a hard stretch where every cycle keeps one token counts once per
    token in both, an easy stretch taken by one long cycle counts once here and at each of its positions there)."""
    anchors, lengths = anchors.cpu().tolist(), lengths.cpu().tolist()
    sup = (loss_mask.cpu().bool() & (doc_ids.cpu() >= 0)).tolist()
    docs = doc_ids.cpu().tolist()
    tokens = cycles = 0
    for row_anchors, row_lengths, s, d in zip(anchors, lengths, sup, docs):
        at = {a: n for a, n in zip(row_anchors, row_lengths) if a >= 0}
        t = 0
        while t < len(s):
            if not s[t]:
                t += 1
                continue
            end = t  # the span [t, end]: supervised positions of one document
            while end + 1 < len(s) and s[end + 1] and d[end + 1] == d[t]:
                end += 1
            a, span_tokens, span_cycles = t, 0, 0
            while a < end and a in at:
                kept = min(at[a], end - a)
                span_tokens, span_cycles, a = span_tokens + kept, span_cycles + 1, a + kept
            if a >= end:  # walked to the response's end
                tokens, cycles = tokens + span_tokens, cycles + span_cycles
            t = end + 1
    return tokens, cycles


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
        if out.greedy_correct is not None:  # logged as {tag}greedy_tau_est (evaluation)
            self.add(f"{tag}greedy_accept_sum", acceptance_sum(out.greedy_correct, out.blocks.anchor_valid))
        if out.greedy_walk is not None:  # logged as {tag}greedy_walk_tau_est (evaluation)
            self.add(f"{tag}greedy_walk_tokens", out.greedy_walk[0])
            self.add(f"{tag}greedy_walk_cycles", out.greedy_walk[1])
        if not tag and out.data_agreement is not None:  # logged as target_agreement (the trainer warns when low)
            self.add("num_target_agreement", out.data_agreement[0])
            self.add("den_target_agreement", out.data_agreement[1])
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
        """Metrics: `{tag}loss` and `{tag}tau_est` per tag (and `{tag}greedy_tau_est`, `{tag}greedy_walk_tau_est`
        when greedy sums were added), per-slot accuracy, and each ratio `num_X / den_X`."""
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
            if f"{tag}greedy_accept_sum" in v:  # against the target's greedy next token, the same blocks
                out[f"{p}{tag}greedy_tau_est"] = 1.0 + (v[f"{tag}greedy_accept_sum"] / nb if nb > 0 else 0.0)
            if f"{tag}greedy_walk_cycles" in v:  # tokens per cycle of the walked decodes (1 without a cycle)
                cycles = v[f"{tag}greedy_walk_cycles"]
                out[f"{p}{tag}greedy_walk_tau_est"] = v[f"{tag}greedy_walk_tokens"] / cycles if cycles > 0 else 1.0
        if self.slot_correct is not None:
            acc = self.slot_correct / self.slot_count.clamp(min=1)
            out[f"{p}accuracy"] = float(self.slot_correct.sum() / self.slot_count.sum().clamp(min=1))
            for k, a in enumerate(acc.tolist(), start=1):
                out[f"{p}acc_slot{k}"] = a
        for name, value in v.items():
            if name.startswith("num_"):  # ratio num_X / den_X
                den = v.get(f"den_{name[len('num_') :]}", 0.0)
                out[f"{p}{name[len('num_') :]}"] = value / den if den > 0 else 0.0
        return out
