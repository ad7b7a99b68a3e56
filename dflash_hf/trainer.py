"""`DFlashTrainer`: a `transformers.Trainer` whose model is the draft; the frozen target lives beside it.

Per micro-batch (DESIGN 3): target forward with tap hooks -> labels -> leading padding moved to the
end -> anchors -> blocks and attention mask -> draft forward -> decayed CE. The loss is normalized by
the weight sum of the *global* batch (every gradient-accumulation micro-batch and every rank), which
`get_batch_samples` computes before any forward because it depends only on anchors and masks.
"""

from __future__ import annotations

import math
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.data_loader import DataLoaderShard
from transformers import DefaultFlowCallback, ProgressCallback, Trainer, TrainerCallback
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    enable_full_determinism,
    has_length,
    rotate_checkpoints,
    set_seed,
)

from .adaptation import apply_adaptation, check_resume_selection, save_selection
from .blocks import (
    Blocks,
    FlexLayout,
    attention_mask_for,
    build_blocks,
    doc_ids_from,
    flex_block_layout,
    leading_padding,
    loss_weight_sum,
    move_leading_padding,
    row_positions,
    sample_anchors,
    slot_validity,
)
from .callbacks import DFlashProgressCallback, RealTauCallback
from .checkpoints import (
    load_data_state,
    mark_complete,
    reporting_full_disk,
    resolve_resume_checkpoint,
    save_data_state,
)
from .configuration_dflash import DFlashConfig, default_gamma
from .distributed import accelerator_uses_fsdp2, shard_frozen_target_layers
from .epochs import EpochStream, ReplayedEpochs, ResumableEpochs
from .hub import check_warm_start, draft_class_for, export_draft, load_draft_strict
from .losses import BlockLoss, DFlash2BlockLoss, MetricSums, block_loss, dflash2_block_loss
from .modeling_dflash import DFlashDecoderLayer, DFlashDraftModel
from .target import FrozenTarget, resolve_dtype
from .training_args import DFlashDataArguments, DFlashTrainingArguments


@dataclass
class BlockPlan:
    """What a micro-batch needs beyond the collator's tensors: rows in left-aligned coordinates and
    the anchors drawn for them. Built before the forward (it fixes the loss denominator)."""

    shifts: torch.Tensor  # [b] leading padding moved to the end
    input_ids: torch.Tensor  # [b, S] decoder-aligned ids (left-aligned)
    real: torch.Tensor  # [b, S] bool: real (non-padding) decoder positions
    loss_mask: torch.Tensor  # [b, S] (left-aligned)
    doc_ids: torch.Tensor  # [b, S]
    positions: torch.Tensor  # [b, S]
    anchors: torch.Tensor  # [b, N]
    weight_sum: torch.Tensor  # scalar
    valid_index: torch.Tensor  # [M] flat indices of the supervised slots in [b, N, B-1]
    flex_layout: FlexLayout | None = None  # tile layout of the flex BlockMask (flex backend only)

    def to(self, device: torch.device) -> BlockPlan:
        """The plan on `device`. Planning happens on the CPU; the copies do not wait for the device."""
        moved = {k: v if v is None else v.to(device, non_blocking=True) for k, v in vars(self).items()}
        return BlockPlan(**moved)


def is_speech_source(dataset) -> bool:
    """Speech sources (paths, `dflash_hf.data.DataSource`s, lhotse `CutSet`s) are batched by the lhotse
    loader, not by the Trainer's sampler. Checked by module so lhotse is imported only when used."""
    items = dataset if isinstance(dataset, (list, tuple)) else [dataset]
    return bool(items) and all(
        isinstance(x, (str, Path)) or type(x).__module__.startswith(("lhotse.", "dflash_hf.data.")) for x in items
    )


def _host_batches(loader):
    """Keep an accelerate `DataLoaderShard`'s batches on the host: `get_batch_samples` plans anchors from host
    tensors (no device sync) and `DFlashTrainer._prepare_input` copies them to the device asynchronously."""
    if isinstance(loader, DataLoaderShard):
        loader.device = None
    return loader


def _scalar_on(value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`value` as a float32 scalar on `device`, without waiting for the device: a Python number is filled in by a
    kernel (`torch.as_tensor` would make a blocking host-to-device copy), a tensor is copied asynchronously."""
    if torch.is_tensor(value):
        return value.to(device=device, dtype=torch.float32, non_blocking=True)
    return torch.full((), float(value), dtype=torch.float32, device=device)


def _seed(*parts: int) -> int:
    """A generator seed from integers (stable across processes, unlike hashing strings)."""
    seed = 0
    for p in parts:
        seed = (seed * 1_000_003 + int(p) + 7) % (2**61 - 1)
    return seed


def seed_like_trainer(args: DFlashTrainingArguments) -> None:
    """Seed every RNG as `Trainer.__init__` does, so a draft built (and adapted) before it is seeded too."""
    if args.full_determinism:
        enable_full_determinism(args.seed)
    else:
        set_seed(args.seed)


class DataEpochCallback(TrainerCallback):
    """The Trainer sees a loader without a length as one endless epoch (`EpochStream`); this callback logs the
    data epoch as `epoch` (monotonic across resumes) and applies the `epoch` logging / evaluation / save
    strategies at the step in which a data epoch ends."""

    def __init__(self, trainer: DFlashTrainer):
        self.trainer = trainer
        self.epochs_done = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.epochs_done = int(state.epoch or 0)

    def on_step_end(self, args, state, control, **kwargs):
        position = self.trainer.train_position
        if position is None:
            return control
        state.epoch = position.epoch_progress
        if int(state.epoch) > self.epochs_done:
            self.epochs_done = int(state.epoch)
            return DefaultFlowCallback().on_epoch_end(args, state, control)
        return control


def build_draft(args: DFlashTrainingArguments, target: FrozenTarget) -> DFlashDraftModel:
    """A fresh draft sized from the target, or a strict warm start from `init_from_pretrained`."""
    if args.init_from_pretrained:
        draft = load_draft_strict(args.init_from_pretrained, block_size=args.block_size)
        check_warm_start(
            draft.config, variant=args.variant, target_layer_ids=args.target_layer_ids, mask_token_id=args.mask_token_id
        )
    else:
        target.validate(mask_token_id=args.mask_token_id, target_layer_ids=args.target_layer_ids)
        config = DFlashConfig.from_target_config(
            target.text_config,
            mask_token_id=args.mask_token_id,
            variant=args.variant,
            num_hidden_layers=args.num_draft_layers,
            block_size=args.block_size,
            target_layer_ids=args.target_layer_ids,
            conv_kernel_size=args.conv_kernel_size,
            conv_group_size=args.conv_group_size,
            selector_rank=args.selector_rank,
            selector_top_k=args.selector_top_k,
        )
        config.vocab_size = target.vocab_size
        draft = draft_class_for(config)(config)
    cfg = draft.config
    target.validate(mask_token_id=cfg.mask_token_id, target_layer_ids=cfg.target_layer_ids, hidden_size=cfg.hidden_size)
    return draft.to(resolve_dtype(args.precision))


class DFlashTrainer(Trainer):
    loss_is_scaled_for_ga = True  # compute_loss divides by the global-batch denominator itself

    def __init__(
        self,
        model=None,
        args: DFlashTrainingArguments = None,
        *,
        target,
        processor=None,
        data_args: DFlashDataArguments | None = None,
        **kwargs,
    ):
        """`target`: the frozen HF model (or a `FrozenTarget`). `train_dataset` / `eval_dataset` may be
        speech sources (`DataSource`, paths, a lhotse `CutSet`, or a dict of named ones for eval): they are
        batched by the lhotse token-budget loader with `processor` and `data_args`; any other dataset goes
        through the standard Trainer path with `data_collator`."""
        self.processor = processor
        self.data_args = data_args or DFlashDataArguments()
        if not isinstance(target, FrozenTarget):
            target = FrozenTarget(target, args.target_family)
        target.model.to(resolve_dtype(args.precision))
        self.target = target
        if args.packing:
            target.check_packing()  # before the draft is built
        seed_like_trainer(args)  # the draft's initial weights (and LoRA's) follow --seed
        if model is None:
            model = build_draft(args, target)
        else:
            cfg = model.config
            target.validate(
                mask_token_id=cfg.mask_token_id, target_layer_ids=cfg.target_layer_ids, hidden_size=cfg.hidden_size
            )
        model = apply_adaptation(model, args)  # projection_only filter or peft LoRA
        super().__init__(model=model, args=args, **kwargs)
        self.target.model.to(self.args.device)
        if accelerator_uses_fsdp2(self.accelerator):  # the target is not Trainer.model: shard it here
            shard_frozen_target_layers(self.target)
        if args.compile_draft_layers and self.args.device.type == "cuda":
            for module in self.model.modules():
                if isinstance(module, DFlashDecoderLayer):
                    module.compile()
        cfg = model.config
        self.block_size = cfg.block_size
        self.gamma = args.gamma or default_gamma(self.block_size)
        self.train_sums = MetricSums()
        for cb in list(self.callback_handler.callbacks):  # concise bar: loss / tau_est as postfix
            if type(cb) is ProgressCallback:
                self.callback_handler.remove_callback(cb)
                self.add_callback(DFlashProgressCallback(cb.max_str_len))
        if args.real_tau_steps > 0:
            self.add_callback(RealTauCallback(self))
        self.add_callback(DataEpochCallback(self))
        self._resume_checkpoint: str | None = None  # set by train()
        self._checkpoint_completed = False  # within a save: its marker is written
        self.train_position: ResumableEpochs | None = None  # data position of a loader without a length
        self._user_ignores_data_skip = args.ignore_data_skip

    # ------------------------------------------------------------------------------------------
    # Speech data: lhotse loaders (already sharded by rank, so not re-prepared by accelerate)
    # ------------------------------------------------------------------------------------------
    def _speech_loader(self, source, shuffle: bool):
        from .data import build_train_dataloader

        if self.processor is None:
            raise ValueError("speech data needs the target's processor: pass DFlashTrainer(processor=...)")
        da = self.data_args
        return build_train_dataloader(
            source,
            self.processor,
            self.target.model.config,
            family=self.target.family,
            max_tokens=self.args.packing_max_tokens if self.args.packing else da.max_tokens,
            max_batch_size=da.max_batch_size,
            conversation=da.conversation(),
            padding_side=da.padding_side,
            shuffle=shuffle,
            seed=self.args.seed,
            world_size=self.args.world_size,
            rank=self.args.process_index,
            num_buckets=da.num_buckets,
            num_workers=self.args.dataloader_num_workers,
            skip_bad_samples=da.skip_bad_samples,
            resample_audio=da.resample_audio,
            packing=self.args.packing,
        )

    def get_train_dataloader(self):
        """Speech sources: the lhotse loader. A loader without a length (lhotse, an HF `IterableDataset`) reaches
        the Trainer as an `EpochStream`: its data position is restored here from the resumed checkpoint."""
        self.train_position = None
        if is_speech_source(self.train_dataset):
            if self.args.max_steps <= 0:
                raise ValueError("speech data streams through lhotse and has no length: set max_steps (> 0)")
            self.speech_train_loader = self._speech_loader(self.train_dataset, shuffle=True)
            self.train_position = self.speech_train_loader
        else:
            loader = _host_batches(super().get_train_dataloader())
            if not self._streams_epochs():
                return loader
            self.train_position = ReplayedEpochs(loader)
        if self._resume_checkpoint and not self._user_ignores_data_skip:
            self.train_position.load_state_dict(
                load_data_state(self._resume_checkpoint, self.args.process_index, self.args.world_size)
            )
        return EpochStream(self.train_position)  # the Trainer counts and skips nothing

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if is_speech_source(dataset):
            return self._speech_loader(dataset, shuffle=False)
        return _host_batches(super().get_eval_dataloader(eval_dataset))

    def _prepare_input(self, data):
        """Host tensors go to the accelerator asynchronously (the micro-batch's anchors were already planned on
        the host, so nothing has to wait for the device before its kernels are queued)."""
        if isinstance(data, torch.Tensor) and data.device.type == "cpu" and self.args.device.type == "cuda":
            if not self.is_deepspeed_enabled:
                return data.to(self.args.device, non_blocking=True)
        return super()._prepare_input(data)

    # ------------------------------------------------------------------------------------------
    # Checkpoints and export (the trainable selection is recorded so resumes can be checked)
    # ------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`resume_from_checkpoint`: a complete checkpoint directory, or true (also the string "true") for the
        last complete one in `output_dir`; incomplete ones (interrupted saves) are skipped and logged."""
        checkpoint = resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if checkpoint:
            check_resume_selection(self.accelerator.unwrap_model(self.model), checkpoint)
        self._resume_checkpoint = checkpoint
        with self._loader_keeps_data_position():
            return super().train(checkpoint, *args, **kwargs)

    @contextmanager
    def _loader_keeps_data_position(self):
        """A loader without a length gets its position restored in `get_train_dataloader`; the Trainer's batch
        skipping, which counts `max_steps` as one epoch, must not apply to it. `ignore_data_skip` is set only for
        the call."""
        self._user_ignores_data_skip = self.args.ignore_data_skip
        if self._streams_epochs():
            self.args.ignore_data_skip = True
        try:
            yield
        finally:
            self.args.ignore_data_skip = self._user_ignores_data_skip

    def _streams_epochs(self) -> bool:
        """Whether the training data has no length, so it is trained on as an `EpochStream`."""
        return is_speech_source(self.train_dataset) or not has_length(self.train_dataset)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            save_selection(self.accelerator.unwrap_model(self.model), output_dir or self.args.output_dir)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint plus each rank's data position, marked complete only once every rank has
        written its part; older checkpoints are rotated away only after that (docs/RELIABILITY.md)."""
        run_dir = self._get_output_dir(trial=trial)
        folder = Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        self._checkpoint_completed = False
        if self.args.should_save and folder.exists():  # an interrupted save of this step: start it afresh
            shutil.rmtree(folder)
        self.accelerator.wait_for_everyone()
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            with reporting_full_disk(folder):
                super()._save_checkpoint(model, trial)
                self._complete_checkpoint(folder)
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            rotate_checkpoints(run_dir, limit, self.state.best_model_checkpoint, use_mtime=True)

    def _complete_checkpoint(self, folder: Path) -> None:
        """Each rank's data position, then, once every rank is done, the completeness marker (once per save)."""
        if self._checkpoint_completed:
            return
        self._checkpoint_completed = True
        if self.train_position is not None:
            state = self.train_position.state_dict() | {"world_size": self.args.world_size}
            save_data_state(folder, self.args.process_index, state)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            mark_complete(folder, self.state.global_step)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """`hub_strategy` checkpoint pushes happen inside the save: complete the checkpoint first, so that the
        pushed copy can be resumed (data position and marker included)."""
        self._complete_checkpoint(Path(checkpoint_folder))
        super()._push_from_checkpoint(checkpoint_folder)

    def export_draft(self, export_dir: str | None = None) -> str:
        """Write the draft in the checkpoint contract (LoRA merged); default `args.resolved_export_dir`."""
        export_dir = export_dir or self.args.resolved_export_dir
        # FSDP shards the parameters: gather a full state dict first (a collective: every rank takes part)
        state_dict = self.accelerator.get_state_dict(self.model) if self.is_fsdp_enabled else None
        if self.args.should_save:
            with reporting_full_disk(export_dir):
                export_draft(self.accelerator.unwrap_model(self.model), export_dir, state_dict=state_dict)
        self.accelerator.wait_for_everyone()
        return export_dir

    def final_eval_metrics(self) -> dict[str, float]:
        """Validation metrics of the trained draft: those of the evaluation the Trainer already ran at the last
        step (when `eval_steps` divides `max_steps`), else a new evaluation. A best checkpoint loaded at the end
        (`load_best_model_at_end`) is another draft, so it is evaluated anew."""
        step = self.state.global_step
        best_loaded = self.args.load_best_model_at_end and self.state.best_global_step not in (None, step)
        done: dict[str, float] = {}
        for entry in self.state.log_history:  # evaluate() logs each validation set with its *_runtime
            if entry.get("step") == step and any(k.startswith("eval") and k.endswith("_runtime") for k in entry):
                done.update({k: v for k, v in entry.items() if k.startswith("eval")})
        return done if done and not best_loaded else self.evaluate()

    # ------------------------------------------------------------------------------------------
    # Planning: anchors and the global denominator, before any forward
    # ------------------------------------------------------------------------------------------
    @property
    def draft_config(self) -> DFlashConfig:
        return self.accelerator.unwrap_model(self.model).config

    def plan_blocks(self, batch: dict, seed: int) -> BlockPlan:
        """Anchors, slot validity and the loss denominator of one micro-batch, on the CPU (the step itself
        then never waits for the device to learn shapes or indices)."""
        pos_ids = batch.get("position_ids") if "cu_seqlens" in batch else None
        pos_ids = pos_ids.cpu() if pos_ids is not None else None
        self._check_layout(batch)
        self._check_mask_token(batch)
        streams = self.target.streams(batch)  # decoder-aligned (model-side audio expansion applied)
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
            self.args.num_anchors,
            generator=gen,
            per_document=pos_ids is not None,
            budget=self.args.anchor_budget,
            pad_multiple=self.args.anchor_pad_multiple,
        )
        valid = slot_validity(loss_mask, doc_ids, anchors, self.block_size)
        weight_sum = loss_weight_sum(valid, self.gamma)
        ids = move_leading_padding(streams.input_ids.cpu(), shifts)
        flex = self._backend(self.args.device) == "flex"
        return BlockPlan(
            shifts, ids, am_rows.bool(), loss_mask, doc_ids, positions, anchors, weight_sum,
            valid_index=valid.flatten().nonzero().squeeze(1),
            flex_layout=flex_block_layout(anchors, doc_ids, self.block_size) if flex else None,
        )

    def _check_layout(self, batch: dict) -> None:
        """Packed batches (with `cu_seqlens`) need `packing=True`, whose target check ran at construction."""
        packed = "cu_seqlens" in batch
        if packed != self.args.packing:
            kind = "a packed batch (it has cu_seqlens)" if packed else "a padded batch (no cu_seqlens)"
            raise ValueError(f"the data collator produced {kind} but packing={self.args.packing}; set packing="
                             f"{packed} (and packing_max_tokens) so the target and the anchor budget are checked")
        if packed and ("position_ids" not in batch or batch["input_ids"].shape[0] != 1):
            raise ValueError("a packed batch needs one row (input_ids [1, T]) and position_ids restarting at 0 per "
                             f"document; got input_ids {tuple(batch['input_ids'].shape)}, keys {sorted(batch)}")

    def _check_mask_token(self, batch: dict) -> None:
        mask_id = self.draft_config.mask_token_id
        hits = (batch["input_ids"] == mask_id).nonzero()
        if len(hits):
            raise ValueError(
                f"mask_token_id {mask_id} occurs in the data (batch rows {sorted(set(hits[:, 0].tolist()))}); "
                "choose a reserved id that the tokenizer never emits for your data"
            )

    def _anchor_seed(self, micro_step: int) -> int:
        # Deterministic per (seed, optimizer step, micro-batch, rank): resumable without RNG state.
        return _seed(self.args.seed, self.state.global_step, micro_step, self.args.process_index)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        total = torch.zeros((), dtype=torch.float64)
        for i, batch in enumerate(batch_samples):
            batch["dflash_prep"] = self.plan_blocks(batch, self._anchor_seed(i))
            total += batch["dflash_prep"].weight_sum.double().cpu()
        total = total.to(device, non_blocking=True)
        if self.args.world_size > 1:
            total = self.accelerator.reduce(total, reduction="sum")
        return batch_samples, total

    # ------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------
    def _backend(self, device: torch.device) -> str:
        backend = self.args.attention_backend
        if backend == "auto":
            return "flex" if device.type == "cuda" else "sdpa"
        return backend

    def draft_forward(self, model, batch: dict, plan: BlockPlan) -> BlockLoss:
        """Target taps -> labels -> blocks -> draft -> decayed CE sums (one micro-batch)."""
        args = self.args
        cfg = self.draft_config
        argmax = args.label_source == "target_argmax"
        feats = self.target.capture(batch, cfg.target_layer_ids, keep_final=argmax)
        dev = feats.taps.device
        on_dev = plan.to(dev)
        taps = move_leading_padding(feats.taps, plan.shifts)
        taps = torch.where(on_dev.real[..., None], taps, torch.zeros((), dtype=taps.dtype, device=dev))
        ids = on_dev.input_ids
        if argmax:  # label positions are found on the CPU plan
            final = move_leading_padding(feats.final_hidden, plan.shifts)
            labels = self.target.argmax_labels(final, ids, plan.loss_mask, plan.doc_ids, args.target_argmax_chunk_size)
        else:
            labels = ids
        blocks = build_blocks(
            ids, labels, on_dev.loss_mask, on_dev.doc_ids, on_dev.positions, on_dev.anchors,
            self.block_size, cfg.mask_token_id, self.gamma, valid_index=on_dev.valid_index,
        )
        hidden = self.run_draft(model, taps, on_dev.positions, on_dev.doc_ids, blocks, on_dev.flex_layout)
        if cfg.variant == "dflash2":  # needs the dense logits: base and selector CE from the same chunks
            selector = self.accelerator.unwrap_model(model).candidate_selector
            return dflash2_block_loss(hidden, blocks, self.target.lm_head.weight, selector, args.ce_chunk_size)
        return block_loss(hidden, blocks, self.target.lm_head.weight, args.ce_chunk_size, args.use_fused_linear_ce)

    def run_draft(self, model, taps, positions, doc_ids, blocks: Blocks, layout: FlexLayout | None = None):
        """Draft hidden of every slot: `[b, N, B, H]`."""
        b, n, bs = blocks.ids.shape
        mask = attention_mask_for(self._backend(taps.device), blocks.anchors, doc_ids, bs, layout)
        with torch.no_grad():
            noise = self.target.embed_tokens(blocks.ids.view(b, n * bs))
        pos = torch.cat([positions, blocks.positions.view(b, n * bs)], dim=1)
        hidden = model(position_ids=pos, attention_mask=mask, noise_embedding=noise, target_hidden=taps)
        return hidden.view(b, n, bs, -1)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        plan = inputs.pop("dflash_prep", None) or self.plan_blocks(inputs, self._anchor_seed(0))
        out = self.draft_forward(model, inputs, plan)
        denom = num_items_in_batch if num_items_in_batch is not None else out.weight_sum
        denom = _scalar_on(denom, out.loss_sum.device)
        skipped = denom <= 0  # stays on the device: no sync per micro-batch
        loss = out.loss_sum / denom.clamp(min=1e-12)
        if isinstance(out, DFlash2BlockLoss):
            in_step = model.training and num_items_in_batch is not None
            loss = loss + self.args.selector_loss_weight * self.selector_loss(out, in_step)
        if model.training and num_items_in_batch is not None and self.args.world_size > 1:
            loss = loss * self.args.world_size  # DDP averages gradients over ranks
        if model.training:
            self.train_sums.add_block_loss(out)
            self.train_sums.add("anchors", plan.anchors.ge(0).sum())
            self.train_sums.add("skipped", skipped)
            self.train_sums.add("micro_batches", 1)
        return (loss, out) if return_outputs else loss

    def selector_loss(self, out: DFlash2BlockLoss, in_training_step: bool) -> torch.Tensor:
        """DFlash2 selector term with its own denominator `D` (the decay weight of slots whose label is
        among the top-k candidates). `D` depends on the draft logits, so unlike the base denominator it is
        unknown before the first micro-batch's backward.

        In a training step, micro-batch i of G (gradient accumulation) contributes `S_i / (D_i * G)`, where
        `S_i` is its selector CE sum and `D_i` its denominator all-reduced over the data-parallel ranks
        (exact across ranks; every rank joins the all-reduce, also one without valid anchors). The step
        optimizes the mean over micro-batches of the DP-global selector loss, which equals DESIGN's
        global `sum S / sum D` when G == 1 or the `D_i` are equal (a deviation otherwise). Logged
        `selector_loss` is the exact global ratio. Outside a training step: `S / D` of this batch."""
        sel = out.selector
        denom = sel.weight_sum.to(device=sel.loss_sum.device, dtype=torch.float32)
        if not in_training_step:
            return sel.loss_sum / denom.clamp(min=1e-12)
        if self.args.world_size > 1:
            denom = self.accelerator.reduce(denom, reduction="sum")
        # set by Trainer.train; a compute_loss call outside it (a custom loop) takes the configured count
        accumulation = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        return sel.loss_sum / denom.clamp(min=1e-12) / accumulation

    # ------------------------------------------------------------------------------------------
    # Logging and evaluation
    # ------------------------------------------------------------------------------------------
    def _report(self, sums: MetricSums, prefix: str = "") -> dict[str, float]:
        """Metrics of all-reduced sums. For DFlash2, `loss` is the optimized objective
        `base + selector_loss_weight * selector` and the decayed CE alone is `base_loss`."""
        metrics = self._all_reduce_sums(sums).reduce()
        if f"{prefix}selector_loss" in metrics:
            metrics[f"{prefix}base_loss"] = metrics[f"{prefix}loss"]
            metrics[f"{prefix}loss"] += self.args.selector_loss_weight * metrics[f"{prefix}selector_loss"]
        return metrics

    def _all_reduce_sums(self, sums: MetricSums) -> MetricSums:
        if self.args.world_size > 1:
            names, vec = sums.as_tensor(self.args.device)
            sums.load_tensor(names, self.accelerator.reduce(vec, reduction="sum"))
        return sums

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.train_sums.values:
            sums = self.train_sums
            sums.settle()
            metrics = self._report(sums)
            # sums cover every rank: micro-batches / (GA * ranks) = optimizer steps in this logging window
            steps = max(
                sums.values.get("micro_batches", 1.0) / (self.args.gradient_accumulation_steps * self.args.world_size),
                1.0,
            )
            logs["loss"] = round(metrics.pop("loss"), 6)
            logs.update({k: round(v, 5) for k, v in metrics.items()})
            logs["anchors_per_step"] = sums.values.get("anchors", 0.0) / steps
            # every micro-batch of a skipped step (global denominator 0) on every rank counted one
            logs["skipped_steps"] = sums.values.get("skipped", 0.0) / (
                self.args.gradient_accumulation_steps * self.args.world_size
            )
            self.train_sums = MetricSums()
        super().log(logs, start_time)

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss, per-slot accuracy and tau_est on each validation set, with the training label source.
        Anchors are seeded by batch index, so the same draft and data always give the same metrics."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, dict):
            metrics: dict[str, float] = {}
            for name, ds in dataset.items():
                metrics.update(self.evaluate(ds, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        start = time.time()
        model = self.model
        model.eval()
        sums = MetricSums(prefix=f"{metric_key_prefix}_")
        dataloader = self.get_eval_dataloader(dataset)
        self.callback_handler.eval_dataloader = dataloader
        for step, batch in enumerate(dataloader):
            plan = self.plan_blocks(batch, _seed(self.args.seed, -1, step, self.args.process_index))  # host batch
            batch = self._prepare_inputs(batch)
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
            out = self.draft_forward(model, batch, plan)
            sums.add_block_loss(out)
        metrics = self._report(sums, f"{metric_key_prefix}_")
        metrics[f"{metric_key_prefix}_runtime"] = round(time.time() - start, 4)
        if not math.isfinite(metrics.get(f"{metric_key_prefix}_loss", 0.0)):
            raise FloatingPointError(f"non-finite {metric_key_prefix}_loss")
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
