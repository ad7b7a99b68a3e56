"""The training objective of one micro-batch, without a Trainer (docs/ARCHITECTURE.md, "One training step").

`DFlashObjective.plan(target, batch, seed)` runs on the host before the step: leading padding, documents,
positions, anchors, slot validity (computed once, here), the flat indices of the supervised slots, the loss
denominator and the flex tile layout, as a `BlockPlan`. `DFlashObjective.loss(draft, target, batch, plan)` then
runs target taps -> labels (`labels/`) -> blocks -> draft -> loss (`losses/`) and returns the micro-batch's sums
and denominators (`BlockLoss`); `normalize` turns them into the scalar to backpropagate, the one place where a
planned (global-batch) denominator and a denominator known only after the forward are each applied.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from accelerate.utils import extract_model_from_parallel
from torch import nn

from dflash_hf.models.configuration_dflash import DFlashConfig
from dflash_hf.objective.blocks import (
    Blocks,
    FlexLayout,
    attention_mask_for,
    build_blocks,
    doc_ids_from,
    flex_block_layout,
    leading_padding,
    move_leading_padding,
    row_positions,
    sample_anchors,
    slot_validity,
)
from dflash_hf.objective.greedy import data_agreement, score_greedy
from dflash_hf.objective.labels import LABEL_SOURCES, LabelSource, make_label_source
from dflash_hf.objective.losses import LOSSES, BlockLoss, DFlash2BlockLoss, MetricSums, SlotLoss, make_loss
from dflash_hf.objective.losses.ce import block_loss
from dflash_hf.objective.losses.selector import dflash2_block_loss
from dflash_hf.ops.float8 import check_lm_head_shape
from dflash_hf.settings import ObjectiveSettings
from dflash_hf.targets.frozen import FrozenTarget


@dataclass
class BlockPlan:
    """What a micro-batch needs beyond the collator's tensors: rows in left-aligned coordinates and
    the anchors drawn for them. Built before the forward (it fixes the loss denominator), for one batch only: its
    shifts, anchors and target host facts describe that batch."""

    shifts: torch.Tensor  # [b] leading padding moved to the end
    input_ids: torch.Tensor  # [b, S] decoder-aligned ids (left-aligned)
    real: torch.Tensor  # [b, S] bool: real (non-padding) decoder positions
    loss_mask: torch.Tensor  # [b, S] (left-aligned)
    doc_ids: torch.Tensor  # [b, S]
    positions: torch.Tensor  # [b, S]
    anchors: torch.Tensor  # [b, N]
    denominator: torch.Tensor  # scalar: the loss's planned denominator (Σ slot weights for the decayed CE)
    valid: torch.Tensor  # [b, N, B-1] bool: supervised slots (`slot_validity`, computed once, here)
    valid_index: torch.Tensor  # [M] flat indices of the supervised slots in [b, N, B-1]
    flex_layout: FlexLayout | None = None  # tile layout of the flex BlockMask (flex backend only)
    target_host: dict | None = None  # `FrozenTarget.host_facts` of the host batch (stays on the host)

    @property
    def padded(self) -> bool | None:
        """Whether the micro-batch has padding, known on the host from the CPU plan (None for a plan moved to a
        device: reading it there would synchronize); the target's decoder mask is prebuilt from it."""
        return None if self.real.is_cuda else not bool(self.real.all())

    def to(self, device: torch.device) -> BlockPlan:
        """The plan on `device`. Planning happens on the CPU; the copies do not wait for the device."""
        moved = {
            k: v if v is None or k == "target_host" else v.to(device, non_blocking=True) for k, v in vars(self).items()
        }
        return BlockPlan(**moved)


def stable_seed(*parts: int) -> int:
    """A generator seed from integers (stable across processes, unlike hashing strings): plans are seeded by
    (seed, optimizer step, micro-batch, rank), so a resumed run draws the same anchors without RNG state."""
    seed = 0
    for p in parts:
        seed = (seed * 1_000_003 + int(p) + 7) % (2**61 - 1)
    return seed


def summed_denominator(plans) -> torch.Tensor:
    """The planned denominators of `plans` (one optimizer step's micro-batches) summed on the host in float64."""
    total = torch.zeros((), dtype=torch.float64)
    for plan in plans:
        total += plan.denominator.double().cpu()
    return total


def fused_ce_conflict(variant: str, loss_type: str, label_source: str) -> str | None:
    """Why the fused lm_head + CE cannot run with these options (None when it can)."""
    if variant == "dflash2":
        return "DFlash2 needs the dense draft logits (its path selector takes the top-k candidates of every slot)"
    if not LOSSES[loss_type].weights_before_forward:
        return f"loss_type={loss_type} derives its slot weights from the draft's own CE (dense chunked logits)"
    if LABEL_SOURCES[label_source].soft:
        return f"label_source={label_source} gives soft labels (the fused kernel takes hard labels)"
    return None


def resolve_fused_ce(settings, variant: str) -> bool:
    """`settings.use_fused_linear_ce` (the training arguments or `ObjectiveSettings`), unset: whether the fused
    lm_head + CE can run with the label source, loss and variant; set true where it cannot: a ValueError."""
    conflict = fused_ce_conflict(variant, settings.loss_type, settings.label_source)
    if settings.use_fused_linear_ce and conflict:
        raise ValueError(f"use_fused_linear_ce=true: {conflict}; set use_fused_linear_ce=false")
    return conflict is None if settings.use_fused_linear_ce is None else bool(settings.use_fused_linear_ce)


def check_float8_lm_head(settings, config: DFlashConfig) -> None:
    """`settings.float8_lm_head` (the training arguments refuse it without the fused CE), refused where `_scaled_mm`
    cannot take the lm_head: its vocabulary and hidden size must be multiples of 16."""
    if settings.float8_lm_head:
        check_lm_head_shape(config.vocab_size, config.hidden_size)


def _scalar_on(value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`value` as a float32 scalar on `device`, without waiting for the device: a Python number is filled in by a
    kernel (`torch.as_tensor` would make a blocking host-to-device copy), a tensor is copied asynchronously."""
    if torch.is_tensor(value):
        return value.to(device=device, dtype=torch.float32, non_blocking=True)
    return torch.full((), float(value), dtype=torch.float32, device=device)


@dataclass
class DFlashObjective:
    """Everything one micro-batch's loss depends on: the objective's options (`settings`: `ObjectiveSettings`, where
    their defaults, help and checks live), the draft's contract fields and what is made of both. It has no defaults of
    its own: `from_settings` (or `from_args`, from the training arguments) builds it from the settings and the draft's
    config."""

    settings: ObjectiveSettings  # anchors, packing, attention backend, chunk sizes (`use_fused_linear_ce` resolved)
    block_size: int  # draft slots per anchor
    mask_token_id: int  # id of the block's mask slots
    target_layer_ids: list[int]  # tapped target decoder layers
    variant: str  # dflash or dflash2 (adds the selector term)
    gamma: float  # slot decay w_k = exp(-(k-1)/gamma) of the decayed CE (`settings.gamma`, or the recipe's)
    slot_loss: SlotLoss  # the --loss_type
    label_source: LabelSource  # the --label_source
    encoder_context: bool  # the draft attends to the encoder frames (dflash_config.encoder_hidden_size)

    @classmethod
    def from_settings(cls, settings: ObjectiveSettings, config: DFlashConfig) -> DFlashObjective:
        """From the objective's settings and the draft's config (an unset `use_fused_linear_ce` resolved; the FP8
        lm_head and the label source checked against the draft's dimensions)."""
        if settings.use_fused_linear_ce is None:  # (a value given is checked where it is given: the arguments)
            settings = replace(settings, use_fused_linear_ce=resolve_fused_ce(settings, config.variant))
        label_source = make_label_source(settings)
        label_source.check(config.vocab_size)
        slot_loss = make_loss(settings)
        check_float8_lm_head(settings, config)
        return cls(
            settings=settings,
            block_size=config.block_size,
            mask_token_id=config.mask_token_id,
            target_layer_ids=config.target_layer_ids,
            variant=config.variant,
            gamma=config.loss_gamma(settings.gamma),
            slot_loss=slot_loss,
            label_source=label_source,
            encoder_context=config.encoder_context,
        )

    @classmethod
    def from_args(cls, args, config: DFlashConfig) -> DFlashObjective:
        """From `DFlashTrainingArguments` (or any object with the `ObjectiveSettings` fields) and the draft's config."""
        return cls.from_settings(ObjectiveSettings.of(args), config)

    # --------------------------------------------------------------------------------------------
    # Planning (host side, before the step)
    # --------------------------------------------------------------------------------------------
    def backend(self, device: torch.device) -> str:
        """The attention backend on `device` (`auto`: flex on CUDA, sdpa elsewhere)."""
        if self.settings.attention_backend == "auto":
            return "flex" if device.type == "cuda" else "sdpa"
        return self.settings.attention_backend

    def plan(self, target: FrozenTarget, batch: dict, seed: int) -> BlockPlan:
        """Anchors, slot validity and the loss denominator of one micro-batch, on the CPU (the step itself
        then never waits for the device to learn shapes or indices)."""
        pos_ids = batch.get("position_ids") if "cu_seqlens" in batch else None
        pos_ids = pos_ids.cpu() if pos_ids is not None else None
        self._check_layout(batch)
        self._check_mask_token(batch)
        streams = target.streams(batch)  # decoder-aligned (model-side audio expansion applied)
        target_host = target.host_facts(batch)  # what the target's forward would read back from the device
        am = streams.attention_mask.cpu()
        shifts = leading_padding(am) if pos_ids is None else torch.zeros(am.shape[0], dtype=torch.long)
        am_rows = move_leading_padding(am, shifts)
        loss_mask = move_leading_padding(streams.loss_mask.cpu(), shifts) & am_rows.bool()
        doc_ids = doc_ids_from(am_rows, pos_ids)
        positions = row_positions(am_rows, pos_ids)
        gen = torch.Generator().manual_seed(seed)
        anchors = sample_anchors(
            loss_mask,
            doc_ids,
            self.settings.num_anchors,
            generator=gen,
            per_document=pos_ids is not None,
            budget=self.settings.anchor_budget,
            pad_multiple=self.settings.anchor_pad_multiple,
        )
        valid = slot_validity(loss_mask, doc_ids, anchors, self.block_size)
        ids = move_leading_padding(streams.input_ids.cpu(), shifts)
        flex = self.backend(target.device) == "flex"
        return BlockPlan(
            shifts,
            ids,
            am_rows.bool(),
            loss_mask,
            doc_ids,
            positions,
            anchors,
            denominator=self.slot_loss.planned_denominator(valid, self.gamma),
            valid=valid,
            valid_index=valid.flatten().nonzero().squeeze(1),
            flex_layout=flex_block_layout(anchors, doc_ids, self.block_size) if flex else None,
            target_host=target_host,
        )

    def _check_layout(self, batch: dict) -> None:
        """Packed batches (with `cu_seqlens`) need `packing=True`, whose target check ran at construction."""
        packed = "cu_seqlens" in batch
        if packed != self.settings.packing:
            kind = "a packed batch (it has cu_seqlens)" if packed else "a padded batch (no cu_seqlens)"
            raise ValueError(
                f"the data collator produced {kind} but packing={self.settings.packing}; set packing="
                f"{packed} (and packing_max_tokens) so the target and the anchor budget are checked"
            )
        if packed and ("position_ids" not in batch or batch["input_ids"].shape[0] != 1):
            raise ValueError(
                "a packed batch needs one row (input_ids [1, T]) and position_ids restarting at 0 per "
                f"document; got input_ids {tuple(batch['input_ids'].shape)}, keys {sorted(batch)}"
            )

    def _check_mask_token(self, batch: dict) -> None:
        hits = (batch["input_ids"] == self.mask_token_id).nonzero()
        if len(hits):
            rows = sorted(set(hits[:, 0].tolist()))
            raise ValueError(
                f"mask_token_id {self.mask_token_id} occurs in the data (batch rows {rows}); choose a "
                "reserved id that the tokenizer never emits for your data"
            )

    # --------------------------------------------------------------------------------------------
    # Forward
    # --------------------------------------------------------------------------------------------
    def loss(
        self, draft: nn.Module, target: FrozenTarget, batch: dict, plan: BlockPlan, greedy: bool | None = None
    ) -> BlockLoss:
        """Target taps -> labels -> blocks -> draft -> loss sums and denominators of one micro-batch (`plan`:
        `self.plan(...)`; `draft` may be wrapped; `greedy`, default in eval mode: the `objective.greedy` estimates)."""
        greedy = not draft.training if greedy is None else greedy
        keep_final = self.label_source.needs_final_hidden or greedy
        feats = target.capture(
            batch, self.target_layer_ids, keep_final=keep_final, padded=plan.padded, host=plan.target_host
        )
        dev = feats.taps.device
        on_dev = plan.to(dev)
        taps = move_leading_padding(feats.taps, plan.shifts)
        taps = torch.where(on_dev.real[..., None], taps, torch.zeros((), dtype=taps.dtype, device=dev))
        ids = on_dev.input_ids
        final = move_leading_padding(feats.final_hidden, plan.shifts) if keep_final else None
        labels = self.label_source(target, final, ids, plan)  # label positions are found on the CPU plan
        blocks = build_blocks(
            ids,
            labels.ids,
            on_dev.loss_mask,
            on_dev.doc_ids,
            on_dev.positions,
            on_dev.anchors,
            self.block_size,
            self.mask_token_id,
            self.gamma,
            valid_index=on_dev.valid_index,
            valid=on_dev.valid,
        )
        encoder = feats.encoder_hidden if self.encoder_context else None
        hidden = self.run_draft(
            draft, target, taps, on_dev.positions, on_dev.doc_ids, blocks, on_dev.flex_layout, encoder
        )
        head, chunk, loss, soft = target.lm_head.weight, self.settings.ce_chunk_size, self.slot_loss, labels.soft
        if self.variant == "dflash2":  # needs the dense logits: base and selector CE from the same chunks
            selector = extract_model_from_parallel(draft).candidate_selector
            out = dflash2_block_loss(hidden, blocks, head, selector, chunk, loss, soft)
        else:
            fused, fp8 = self.settings.use_fused_linear_ce, self.settings.float8_lm_head
            out = block_loss(hidden, blocks, head, chunk, fused, loss, soft, fp8)
        if self.label_source.needs_final_hidden:  # the target relabels: how often does it write the data's token?
            out.data_agreement = data_agreement(ids, labels.ids, plan)
        if greedy:
            score_greedy(out, plan, blocks, self.label_source, (target, final, ids))
        return out

    def run_draft(
        self,
        draft: nn.Module,
        target: FrozenTarget,
        taps,
        positions,
        doc_ids,
        blocks: Blocks,
        layout: FlexLayout | None = None,
        encoder_hidden: torch.Tensor | None = None,
    ):
        """Draft hidden of every slot: `[b, N, B, H]`. `encoder_hidden` `[b, F, E]`: the encoder frames an
        encoder-context draft attends to (None for a contract draft)."""
        b, n, bs = blocks.ids.shape
        mask = attention_mask_for(self.backend(taps.device), blocks.anchors, doc_ids, bs, layout)
        with torch.no_grad():
            noise = target.embed_tokens(blocks.ids.view(b, n * bs))
        pos = torch.cat([positions, blocks.positions.view(b, n * bs)], dim=1)
        extra = {} if encoder_hidden is None else {"encoder_hidden_states": encoder_hidden}
        hidden = draft(position_ids=pos, attention_mask=mask, noise_embedding=noise, target_hidden=taps, **extra)
        return hidden.view(b, n, bs, -1)

    # --------------------------------------------------------------------------------------------
    # Normalization and metrics
    # --------------------------------------------------------------------------------------------
    def terms(self, out: BlockLoss) -> list[tuple[float, BlockLoss]]:
        """(coefficient, sums) of every term of the optimized loss: the base loss, then DFlash2's selector."""
        if isinstance(out, DFlash2BlockLoss):
            return [(1.0, out), (self.settings.selector_loss_weight, out.selector)]
        return [(1.0, out)]

    def normalize(
        self,
        out: BlockLoss,
        denominator: float | torch.Tensor | None = None,
        *,
        training_step: bool = False,
        world_size: int = 1,
        accumulation: int = 1,
        all_reduce=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(loss, skipped)`: the scalar to backpropagate and a device flag (the planned denominator is 0).

        `denominator`: the planned denominator of the global batch (`get_batch_samples` sums `BlockPlan.denominator`
        over every micro-batch and rank); default the micro-batch's own. `training_step`: this is one of
        `accumulation` micro-batches of an optimizer step over `world_size` ranks (DDP averages gradients over ranks,
        so the loss is scaled by `world_size`).

        A term whose denominator is known only after the forward (`BlockLoss.denominator_after_forward`, e.g. the
        DFlash2 selector's `D`) cannot be planned: in a training step micro-batch i of G contributes
        `S_i / (D_i * G)`, `D_i` all-reduced over the data-parallel ranks (`all_reduce`; every rank joins it, also
        one without valid anchors). The step optimizes the mean over micro-batches of the DP-global ratio, which
        is the global `Σ S / Σ D` when G == 1 or the `D_i` are equal (a deviation otherwise; the logged metric is
        the exact global ratio). Outside a training step: `S / D` of this batch."""
        loss, skipped = None, None
        for coefficient, term in self.terms(out):
            if term.denominator_after_forward:
                denom = term.weight_sum.to(device=term.loss_sum.device, dtype=torch.float32)
                if training_step and all_reduce is not None:
                    denom = all_reduce(denom)
                value = term.loss_sum / denom.clamp(min=1e-12)
                value = value / accumulation if training_step else value
            else:
                planned = denominator if denominator is not None else term.weight_sum
                denom = _scalar_on(planned, term.loss_sum.device)
                value = term.loss_sum / denom.clamp(min=1e-12)
            if loss is None:
                loss, skipped = value, denom <= 0  # stays on the device: no sync per micro-batch
            else:
                loss = loss + coefficient * value
        if training_step and world_size > 1:
            loss = loss * world_size
        return loss, skipped

    @staticmethod
    def record(sums: MetricSums, out: BlockLoss, plan: BlockPlan, skipped: torch.Tensor) -> None:
        """Add a training micro-batch's statistics to `sums` (device values stay on the device)."""
        sums.add_block_loss(out)
        sums.add("anchors", plan.anchors.ge(0).sum())
        sums.add("skipped", skipped)
        sums.add("micro_batches", 1)

    def report(self, metrics: dict[str, float], prefix: str = "") -> dict[str, float]:
        """Logged metrics from reduced sums. For DFlash2, `loss` is the optimized objective
        `base + selector_loss_weight * selector` and the base loss alone is `base_loss`."""
        if f"{prefix}selector_loss" in metrics:
            metrics[f"{prefix}base_loss"] = metrics[f"{prefix}loss"]
            metrics[f"{prefix}loss"] += self.settings.selector_loss_weight * metrics[f"{prefix}selector_loss"]
        return metrics


__all__ = [
    "BlockPlan",
    "DFlashObjective",
    "check_float8_lm_head",
    "data_agreement",
    "fused_ce_conflict",
    "resolve_fused_ce",
    "stable_seed",
    "summed_denominator",
]
