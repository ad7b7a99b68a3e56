"""`DFlashTrainer`: a `transformers.Trainer` whose model is the draft; the frozen target lives beside it.

The trainer keeps the Trainer hooks; the loss of a micro-batch is `objective.DFlashObjective`'s
(docs/ARCHITECTURE.md): `get_batch_samples` plans every micro-batch of an optimizer step on the host and sums the
planned denominators of the *global* batch (every gradient-accumulation micro-batch and every rank) before any
forward; `compute_loss` runs the objective on the micro-batch with its plan and normalizes it.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import torch
from transformers import Trainer
from transformers.trainer_utils import has_length

from dflash_hf.data.epochs import EpochStream, ReplayedEpochs, ResumableEpochs, trainer_skips_nothing
from dflash_hf.export.run_record import target_identity
from dflash_hf.models.configuration_dflash import DFlashConfig
from dflash_hf.objective.dflash_objective import BlockPlan, DFlashObjective, stable_seed, summed_denominator
from dflash_hf.objective.losses import MetricSums
from dflash_hf.targets.frozen import TargetModel
from dflash_hf.training.adaptation import check_resume_selection, save_selection
from dflash_hf.training.assembly import (
    compile_draft_layers,
    host_batches,
    is_speech_source,
    speech_loader,
    target_and_draft,
)
from dflash_hf.training.callbacks import add_dflash_callbacks
from dflash_hf.training.checkpoints import checkpoint_dir, complete_checkpoint, complete_only_save, load_data_state
from dflash_hf.training.distributed import accelerator_uses_fsdp2, shard_frozen_target_layers
from dflash_hf.training.draft_export import export_trained_draft
from dflash_hf.training.env_faults import StepFaults
from dflash_hf.training.estimates import with_real_tau
from dflash_hf.training.launch import no_hf_progress_bars
from dflash_hf.training.reporting import HostTimes, TrainClock, eval_set_metrics, train_log_entries
from dflash_hf.training.run_start import start_run
from dflash_hf.training.step_guards import FiniteStepGuard, StopSignals
from dflash_hf.training.training_args import DFlashDataArguments, DFlashTrainingArguments
from dflash_hf.training.training_end import final_eval_metrics, resumed_ended, save_last_step, untrained_summary


class DFlashTrainer(Trainer):
    loss_is_scaled_for_ga = True  # compute_loss divides by the global-batch denominator itself

    def __init__(
        self,
        model=None,
        args: DFlashTrainingArguments = None,
        *,
        target: TargetModel,
        processor=None,
        data_args: DFlashDataArguments | None = None,
        **kwargs,
    ):
        """`target`: the frozen HF model (or a `FrozenTarget`); `model`: the draft to train (default: a warm start from
        `args.init_from_pretrained` or a new draft), checked against the target (`assembly.target_and_draft`).
        `train_dataset` / `eval_dataset` may be speech sources (`DataSource`, paths, a lhotse `CutSet`, or a dict of
        named ones for eval): they are batched by the lhotse token-budget loader with `processor` and `data_args`; any
        other dataset goes through the standard Trainer path with `data_collator`."""
        args.check_files()  # the resume checkpoint and warm-start export, before anything loads
        self.processor = processor
        self.data_args = data_args or DFlashDataArguments()
        self.target, model = target_and_draft(target, args, model, processor)
        self.target_identity = target_identity(self.target.model)  # before the target is moved or sharded
        super().__init__(model=model, args=args, **kwargs)
        self.target.model.to(self.args.device)
        if accelerator_uses_fsdp2(self.accelerator):  # the target is not Trainer.model: shard it here
            shard_frozen_target_layers(self.target)
        if "draft" in args.torch_compile_layers and self.args.device.type == "cuda":
            compile_draft_layers(self.model)
        self.objective = DFlashObjective.from_args(args, model.config)
        self.train_sums = MetricSums()
        self.host_times = HostTimes()  # data wait, planning and step wall time, logged beside the loss
        self.train_clock = TrainClock()  # `train_minutes` in every log once the training loop began
        self.stop_signals = StopSignals()  # SIGTERM / SIGINT: checkpoint at the next step boundary, then stop
        self.finite_guard = FiniteStepGuard(check_loss=args.world_size == 1)
        self.run_record: dict | None = None  # run id and settings (run_identity), set by train()
        self._step_plans: list[tuple[dict, BlockPlan]] = []  # this optimizer step's micro-batches and their plans
        self._micro_plan: BlockPlan | None = None
        add_dflash_callbacks(self, args)
        self.step_faults = StepFaults(self)  # full disk, killed loader worker, GPU out of memory (env_faults)
        self.add_callback(self.step_faults.callback)
        self._resume_checkpoint: str | None = None  # set by train()
        self.trains_no_step = False  # a resume from a checkpoint at which training ended (`_init_training_state`)
        self._checkpoint_completed = False  # within a save: its marker is written
        self.train_position: ResumableEpochs | None = None  # data position of a loader without a length
        self._user_ignores_data_skip = args.ignore_data_skip

    # --- Speech data: lhotse loaders (already sharded by rank, so not re-prepared by accelerate)
    def _speech_loader(self, source, shuffle: bool):
        kwargs = {"processor": self.processor, "target": self.target, "args": self.args, "data_args": self.data_args}
        return speech_loader(source, shuffle=shuffle, **kwargs)

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

    # --- Checkpoints and export (the trainable selection is recorded so resumes can be checked)
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`resume_from_checkpoint`: a complete checkpoint directory, or true (also the string "true") for the
        last complete, readable one of the run owning `output_dir`; incomplete ones (interrupted saves) and damaged
        ones are passed over and logged. The run's directories are checked first (`run_identity`), and a resume
        refuses settings that differ from its checkpoint's. SIGTERM / SIGINT save a checkpoint at the next step
        boundary and raise `TrainingInterrupted`."""
        checkpoint, self.run_record = start_run(self, resume_from_checkpoint)
        if checkpoint:
            check_resume_selection(self.accelerator.unwrap_model(self.model), checkpoint)
        self._resume_checkpoint = checkpoint
        self.finite_guard.last_checkpoint = checkpoint
        try:
            with (
                trainer_skips_nothing(self.args, self._streams_epochs()) as self._user_ignores_data_skip,
                self.stop_signals.installed(),
                self.step_faults.handled(),
            ):
                result = super().train(checkpoint, *args, **kwargs)
                step_weights = self.step_faults.in_loop  # False once the best checkpoint was loaded at the end
        finally:
            self.step_faults.in_loop = False  # from here on no fault or signal saves a checkpoint at this step
        self.finite_guard.settle()
        self.step_faults.report(result.metrics)  # --skip_oom_batches: the steps skipped, counted and listed
        if self.stop_signals.signum is not None:
            save = partial(self._save_checkpoint, self.model, trial=None) if step_weights else None
            raise self.stop_signals.after_training(self.args.output_dir, self.state.global_step, save, self.step_faults)
        return result

    def _init_training_state(self, max_steps, per_epoch, num_epochs, resume_from_checkpoint, *args):
        """A resumed checkpoint at which training ended (`training_end.training_ended`) runs no epoch: no step."""
        trained = super()._init_training_state(max_steps, per_epoch, num_epochs, resume_from_checkpoint, *args)
        self.trains_no_step = resumed_ended(self, max_steps, resume_from_checkpoint)
        return (num_epochs, 0) if self.trains_no_step else trained

    def _finalize_training(self, trial, *args, **kwargs):
        """The last step's checkpoint (`training_end.save_last_step`), before a best checkpoint may be loaded."""
        save_last_step(self, trial)
        return super()._finalize_training(trial, *args, **kwargs)

    def _load_best_model(self) -> None:
        """`load_best_model_at_end`: from here the weights are the best checkpoint's, not the last step's; a fault
        or stop signal no longer saves a checkpoint at the last step (`StepFaults.in_loop`)."""
        self.step_faults.in_loop = False
        super()._load_best_model()

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
        self.finite_guard.settle()  # never save a step whose loss or gradient norm is not finite
        run_dir = self._get_output_dir(trial=trial)
        folder = checkpoint_dir(run_dir, self.state.global_step)
        self._checkpoint_completed = False
        with complete_only_save(run_dir, folder, self.args, self.state, self.accelerator):
            super()._save_checkpoint(model, trial)
            self._complete_checkpoint(folder)

    def _complete_checkpoint(self, folder: Path) -> None:
        """Each rank's data position, then the completeness marker (`checkpoints.complete_checkpoint`), once a save."""
        if not self._checkpoint_completed:
            self._checkpoint_completed = True
            complete_checkpoint(self, folder)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """`hub_strategy` checkpoint pushes happen inside the save: complete the checkpoint first, so that the
        pushed copy can be resumed (data position and marker included)."""
        self._complete_checkpoint(Path(checkpoint_folder))
        super()._push_from_checkpoint(checkpoint_folder)

    def export_draft(self, export_dir: str | None = None) -> str:
        """Write the draft in the checkpoint contract (LoRA merged); default `args.resolved_export_dir`."""
        with self.step_faults.handled():
            return export_trained_draft(self, export_dir or self.args.resolved_export_dir)

    def final_eval_metrics(self) -> dict[str, float]:
        """Validation metrics of the trained draft (`training_end.final_eval_metrics`)."""
        return final_eval_metrics(self)

    # --- The objective: plans before the step, the loss of each micro-batch with its plan
    @property
    def draft_config(self) -> DFlashConfig:
        return self.accelerator.unwrap_model(self.model).config

    @property
    def block_size(self) -> int:
        return self.objective.block_size

    def _anchor_seed(self, micro_step: int) -> int:
        # Deterministic per (seed, optimizer step, micro-batch, rank): resumable without RNG state.
        return stable_seed(self.args.seed, self.state.global_step, micro_step, self.args.process_index)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        self.step_faults.step_started()
        batch_samples = self.host_times.fetch(epoch_iterator, num_batches)
        self._step_plans = [
            (b, self.objective.plan(self.target, b, self._anchor_seed(i))) for i, b in enumerate(batch_samples)
        ]
        self.host_times.planned()
        total = summed_denominator(plan for _, plan in self._step_plans).to(device, non_blocking=True)
        if self.args.world_size > 1:
            total = self.accelerator.reduce(total, reduction="sum")
        return batch_samples, total

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's step, with the plan `get_batch_samples` made for this micro-batch (matched by identity:
        `_prepare_inputs` copies the batch before `compute_loss` sees it)."""
        self._micro_plan = next((plan for batch, plan in self._step_plans if batch is inputs), None)
        try:
            run = super().training_step  # GPU out of memory: skipped (--skip_oom_batches) or a clear stop
            loss = self.step_faults.micro_batch(run, model, inputs, num_items_in_batch, self._micro_plan)
        finally:
            self._micro_plan = None
        self.finite_guard.add_loss(loss)
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        """The Trainer's gradient norm of the step about to be taken, checked by `finite_guard` (a non-finite loss
        or norm stops training before the optimizer takes the step; on a GPU one step later, see `step_guards`)."""
        self.step_faults.update_started()
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.finite_guard.observe(grad_norm, self.state.global_step + 1)
        return grad_norm

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, plan: BlockPlan | None = None):
        """The objective's loss of `inputs` with `plan` (default: the one planned in `get_batch_samples`, else planned
        now), normalized by `num_items_in_batch` (the global planned denominator) when given."""
        plan = plan or self._micro_plan or self.objective.plan(self.target, inputs, self._anchor_seed(0))
        out = self.objective.loss(model, self.target, inputs, plan)
        in_step = model.training and num_items_in_batch is not None
        loss, skipped = self.objective.normalize(
            out,
            num_items_in_batch,
            training_step=in_step,
            world_size=self.args.world_size,
            # set by Trainer.train; a compute_loss call outside it (a custom loop) takes the configured count
            accumulation=getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps),
            all_reduce=self._all_reduce if self.args.world_size > 1 else None,
        )
        if model.training:
            self.objective.record(self.train_sums, out, plan, skipped)
        return (loss, out) if return_outputs else loss

    def _all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(value, reduction="sum")

    # --- Logging and evaluation
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
        self.step_faults.annotate(logs, self.train_sums)  # --skip_oom_batches: the skipped steps counted
        if "loss" in logs and self.train_sums.values:
            sums = self.train_sums
            sums.settle()
            metrics = self._report(sums)
            logs.update(train_log_entries(metrics, sums, self.args.gradient_accumulation_steps, self.args.world_size))
            logs.update(self.host_times.entries())
            self.train_sums = MetricSums()
        logs.update(self.train_clock.entries())
        untrained_summary(self, logs)
        super().log(logs, start_time)

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss, per-slot accuracy and tau_est on each validation set, with the training label source, and first its
        real tau (`eval_real_tau`). Anchors are seeded by batch index, so the same draft and data always give the same
        metrics."""
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
            plan = self.objective.plan(self.target, batch, stable_seed(-1, step, self.args.process_index))
            batch = self._prepare_inputs(batch)  # after planning: the plan is made from the host batch
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
            out = self.objective.loss(model, self.target, batch, plan)
            sums.add_block_loss(out)
        metrics = with_real_tau(self._report(sums, f"{metric_key_prefix}_"), self, dataset, metric_key_prefix)
        metrics = eval_set_metrics(metrics, dataloader, metric_key_prefix, start)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
