"""What a `dflash-train` run checks before anything loads (light: no torch): a target, data to train or validate on,
no target code run unasked, the run's output and export directories, a resume checkpoint given by path. The command
line's light parser calls `check_run_inputs` before torch loads, `run_training` again on the parsed arguments."""

from __future__ import annotations

from dflash_hf.settings import ModelSettings, RunSettings
from dflash_hf.targets.processor import check_model_dir, check_remote_code
from dflash_hf.training.argument_groups import check_data_paths


def check_run_inputs(args, data_args) -> None:
    """What every run needs: a target (an existing directory when given as a path) and data to train or
    validate on. `args` / `data_args`: the parsed arguments (or the light parser's namespace for both)."""
    if not args.target_name_or_path:
        raise ValueError("--target_name_or_path is required: the directory of the frozen target model")
    check_run_dirs(args)  # the run's own directories, then the target's and the data's
    check_model_dir(args.target_name_or_path, "target_name_or_path", "the frozen target")
    if args.validate_only:
        if not data_args.eval_data:
            raise ValueError("--validate_only true needs --eval_data NAME=PATH [...] to validate on")
    elif not data_args.train_data:
        raise ValueError("--train_data is required: NeMo manifests or lhotse cut files (or --validate_only true)")
    check_data_paths(data_args)
    trust = getattr(args, "trust_remote_code", ModelSettings.trust_remote_code)
    check_remote_code(args.target_name_or_path, bool(trust))


def check_run_dirs(args) -> None:
    """The run's output and export directories (`training.run_identity.check_run_directories`), before anything
    loads; a validation writes only its metrics, so it is checked only for writing into the target."""
    from dflash_hf.training.run_identity import check_not_in_target, check_run_directories

    output_dir = getattr(args, "output_dir", None) or "trainer_output"  # TrainingArguments' default
    export_dir = getattr(args, "export_dir", None) or f"{output_dir}/draft"
    if args.validate_only:
        check_not_in_target(output_dir, "output_dir", args.target_name_or_path)
        return
    resume = getattr(args, "resume_from_checkpoint", None)
    resuming = resume is not None and str(resume).strip().lower() not in ("", "false")
    check_run_directories(
        output_dir,
        export_dir,
        resuming=resuming,
        overwrite=bool(getattr(args, "overwrite_output_dir", RunSettings.overwrite_output_dir)),
        target=args.target_name_or_path,
    )


def check_resume_path(resume) -> None:
    """A checkpoint given by path is read as resume will read it (`checkpoints.checkpoint_problem`: truncated files,
    pickled code) before the target loads; `true` picks among the checkpoints when training starts."""
    from dflash_hf.training.checkpoints import check_checkpoint_readable, resume_path

    if resume_path(resume) is not None:
        check_checkpoint_readable(resume)


__all__ = ["check_resume_path", "check_run_dirs", "check_run_inputs"]
