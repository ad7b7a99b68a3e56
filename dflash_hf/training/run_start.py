"""The start of a training run: its directories checked, the checkpoint to resume from, and its run record
(`run_identity`), for `DFlashTrainer.train`."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_hf.export.run_record import RunDirectoryError, read_record, write_record
from dflash_hf.training.checkpoints import parse_resume_flag, resolve_resume_checkpoint
from dflash_hf.training.run_identity import (
    check_run_directories,
    clear_previous_run,
    new_record,
    resumed_record,
    run_settings,
)


def start_run(trainer, resume_from_checkpoint) -> tuple[str | None, dict]:
    """Check the run's directories, pick the checkpoint to resume from and the run's record: the resumed run's
    (settings compared, allowed changes recorded) or a new run's; written in `output_dir` (`run_identity`)."""
    args = trainer.args
    resuming = parse_resume_flag(resume_from_checkpoint) not in (None, False)
    previous = check_run_directories(
        args.output_dir,
        args.resolved_export_dir,
        resuming=resuming,
        overwrite=args.overwrite_output_dir,
        target=args.target_name_or_path or trainer.target_identity["name_or_path"],
    )
    trainer.accelerator.wait_for_everyone()
    if args.should_save and previous:
        clear_previous_run(previous, args.output_dir)
    trainer.accelerator.wait_for_everyone()
    owner = read_record(args.output_dir)
    checkpoint = resolve_resume_checkpoint(resume_from_checkpoint, args.output_dir, owner and owner["run_id"])
    settings = run_settings(trainer.draft_config, trainer.target_identity, trainer.train_dataset)
    if checkpoint:
        record = read_record(checkpoint)
        if owner and record and record["run_id"] != owner["run_id"]:
            raise RunDirectoryError(
                f"--resume_from_checkpoint {checkpoint} is of run {record['run_id']}, but --output_dir "
                f"{args.output_dir} belongs to run {owner['run_id']}; resume into the checkpoint's own "
                "output_dir or a new one, or pass --overwrite_output_dir true to replace the run there"
            )
        step = json.loads((Path(checkpoint) / "trainer_state.json").read_text()).get("global_step", 0)
        record = resumed_record(record, checkpoint, settings, args.resume_allow_changes, step)
    else:
        record = new_record(settings)
    trainer.accelerator.wait_for_everyone()  # every rank has read the directory's record before it is replaced
    if args.should_save:
        write_record(args.output_dir, record)
    return checkpoint, record
