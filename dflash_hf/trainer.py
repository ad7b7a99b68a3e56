"""`DFlashTrainer`: a `transformers.Trainer` whose model is the draft; the frozen target lives beside it.

The trainer keeps the Trainer hooks; the loss of a micro-batch is `objective.DFlashObjective`'s
(docs/ARCHITECTURE.md): `get_batch_samples` plans every micro-batch of an optimizer step on the host and sums the
planned denominators of the *global* batch (every gradient-accumulation micro-batch and every rank) before any
forward; `compute_loss` runs the objective on the micro-batch with its plan and normalizes it.
"""

from __future__ import annotations

import math
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import DefaultFlowCallback, ProgressCallback, Trainer, TrainerCallback
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    enable_full_determinism,
    has_length,
    rotate_checkpoints,
    set_seed,
)

from .adaptation import apply_adaptation, check_resume_selection, save_selection
from .assembly import build_draft, host_batches, is_speech_source
from .callbacks import DFlashProgressCallback, RealTauCallback
from .checkpoints import (
    load_data_state,
    mark_complete,
    reporting_full_disk,
    resolve_resume_checkpoint,
    save_data_state,
)
from .configuration_dflash import DFlashConfig
from .distributed import accelerator_uses_fsdp2, shard_frozen_target_layers
from .epochs import EpochStream, ReplayedEpochs, ResumableEpochs
from .hub import export_draft
from .launch import no_hf_progress_bars
from .losses import MetricSums
from .modeling_dflash import DFlashDecoderLayer
from .objective import BlockPlan, DFlashObjective
from .target import FrozenTarget, resolve_dtype
from .training_args import DFlashDataArguments, DFlashTrainingArguments


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
        self.objective = DFlashObjective.from_args(args, model.config)
        self.train_sums = MetricSums()
        self._step_plans: list[tuple[dict, BlockPlan]] = []  # this optimizer step's micro-batches and their plans
        self._micro_plan: BlockPlan | None = None
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
            loader = host_batches(super().get_train_dataloader())
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
        return host_batches(super().get_eval_dataloader(eval_dataset))

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
        with no_hf_progress_bars():  # save_pretrained's "Writing model shards" bar would break the training bar
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
            self.draft_config.dflash_config["num_anchors"] = self.args.num_anchors  # validate_only reuses it
            with reporting_full_disk(export_dir), no_hf_progress_bars():
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
    # The objective: plans before the step, the loss of each micro-batch with its plan
    # ------------------------------------------------------------------------------------------
    @property
    def draft_config(self) -> DFlashConfig:
        return self.accelerator.unwrap_model(self.model).config

    @property
    def block_size(self) -> int:
        return self.objective.block_size

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
        self._step_plans = [(b, self.objective.plan(self.target, b, self._anchor_seed(i))) for i, b in
                            enumerate(batch_samples)]
        total = torch.zeros((), dtype=torch.float64)
        for _, plan in self._step_plans:
            total += plan.denominator.double().cpu()
        total = total.to(device, non_blocking=True)
        if self.args.world_size > 1:
            total = self.accelerator.reduce(total, reduction="sum")
        return batch_samples, total

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's step, with the plan `get_batch_samples` made for this micro-batch (matched by identity:
        `_prepare_inputs` copies the batch before `compute_loss` sees it)."""
        self._micro_plan = next((plan for batch, plan in self._step_plans if batch is inputs), None)
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._micro_plan = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, plan: BlockPlan | None = None):
        """The objective's loss of `inputs` with `plan` (default: the one planned in `get_batch_samples`, else planned
        now), normalized by `num_items_in_batch` (the global planned denominator) when given."""
        plan = plan or self._micro_plan or self.objective.plan(self.target, inputs, self._anchor_seed(0))
        out = self.objective.loss(model, self.target, inputs, plan)
        in_step = model.training and num_items_in_batch is not None
        loss, skipped = self.objective.normalize(
            out, num_items_in_batch, training_step=in_step, world_size=self.args.world_size,
            # set by Trainer.train; a compute_loss call outside it (a custom loop) takes the configured count
            accumulation=getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps),
            all_reduce=self._all_reduce if self.args.world_size > 1 else None,
        )
        if model.training:
            self.objective.record(self.train_sums, out, plan, skipped)
        return (loss, out) if return_outputs else loss

    def _all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(value, reduction="sum")

    # ------------------------------------------------------------------------------------------
    # Logging and evaluation
    # ------------------------------------------------------------------------------------------
    def _report(self, sums: MetricSums, prefix: str = "") -> dict[str, float]:
        """Metrics of all-reduced sums. For DFlash2, `loss` is the optimized objective
        `base + selector_loss_weight * selector` and the decayed CE alone is `base_loss`."""
        return self.objective.report(self._all_reduce_sums(sums).reduce(), prefix)

    def _all_reduce_sums(self, sums: MetricSums) -> MetricSums:
        if self.args.world_size > 1:
            names, vec = sums.as_tensor(self.args.device)
            sums.load_tensor(names, self._all_reduce(vec))
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
            # seeded by batch index only (not args.seed), so validate_only repeats any run's evaluation
            plan = self.objective.plan(self.target, batch, _seed(-1, step, self.args.process_index))
            batch = self._prepare_inputs(batch)  # after planning: the plan is made from the host batch
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
            out = self.objective.loss(model, self.target, batch, plan)
            sums.add_block_loss(out)
        metrics = self._report(sums, f"{metric_key_prefix}_")
        if getattr(dataloader, "bad_samples", None) is not None:  # speech loader: rows skipped in this set
            metrics[f"{metric_key_prefix}_skipped_samples"] = dataloader.bad_samples.num_skipped
        metrics[f"{metric_key_prefix}_runtime"] = round(time.time() - start, 4)
        if not math.isfinite(metrics.get(f"{metric_key_prefix}_loss", 0.0)):
            raise FloatingPointError(f"non-finite {metric_key_prefix}_loss")
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
