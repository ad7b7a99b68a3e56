"""The trained draft's export (`DFlashTrainer.export_draft`): LoRA merged, FSDP shards gathered, the training record
(anchors, conversation) and the run record written inside the export, atomically."""

from __future__ import annotations

from dflash_hf.export.drafts import export_draft
from dflash_hf.export.run_record import write_record
from dflash_hf.export.training_record import TrainingRecord, conversation_record
from dflash_hf.training.adaptation import plain_draft
from dflash_hf.training.assembly import is_speech_source
from dflash_hf.training.checkpoints import reporting_full_disk
from dflash_hf.training.launch import no_hf_progress_bars
from dflash_hf.training.run_identity import export_record


def export_trained_draft(trainer, export_dir: str) -> str:
    """Write the trainer's draft to `export_dir` in the checkpoint contract (every rank calls it: FSDP gathers)."""
    trainer.finite_guard.settle()
    # FSDP shards the parameters: gather a full state dict first (a collective: every rank takes part)
    state_dict = trainer.accelerator.get_state_dict(trainer.model) if trainer.is_fsdp_enabled else None
    if trainer.args.should_save:
        training = TrainingRecord(num_anchors=trainer.args.num_anchors)  # validate_only reuses them
        if is_speech_source(trainer.train_dataset):  # conversations rendered from cuts: dflash-eval renders alike
            training.conversation = conversation_record(trainer.data_args.conversation(), trainer.target.family.name)
        record = None if trainer.run_record is None else export_record(trainer.run_record)

        def write_records(directory) -> None:  # inside the export: what the run used, the run it is of
            training.write(directory)
            if record is not None:
                write_record(directory, record, global_step=trainer.state.global_step)

        draft = plain_draft(trainer.accelerator.unwrap_model(trainer.model), state_dict)
        tokenizer = getattr(trainer.processor, "tokenizer", trainer.processor)
        with reporting_full_disk(export_dir, "export", "export_dir"), no_hf_progress_bars():
            export_draft(
                draft,
                export_dir,
                vocab_size=trainer.target.vocab_size,
                tokenizer=tokenizer,
                write_extra=write_records,
            )
    trainer.accelerator.wait_for_everyone()
    return export_dir
