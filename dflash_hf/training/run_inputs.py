"""What a `dflash-train` run checks before anything loads (light: no torch): a target, data to train or validate on,
no target code run unasked, the run's output and export directories, a resume checkpoint given by path. The command
line's light parser calls `check_run_inputs` before torch loads, `run_training` again on the parsed arguments."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_hf.settings import ModelSettings, RunSettings
from dflash_hf.targets.processor import check_model_dir
from dflash_hf.training.argument_groups import check_data_paths


def check_run_inputs(args, data_args) -> None:
    """What every run needs: a target (an existing directory when given as a path) and data to train or
    validate on. `args` / `data_args`: the parsed arguments (or the light parser's namespace for both)."""
    if not args.target_name_or_path:
        raise ValueError("--target_name_or_path is required: the directory of the frozen target model")
    check_model_dir(args.target_name_or_path, "target_name_or_path", "the frozen target")
    if args.validate_only:
        if not data_args.eval_data:
            raise ValueError("--validate_only true needs --eval_data NAME=PATH [...] to validate on")
    elif not data_args.train_data:
        raise ValueError("--train_data is required: NeMo manifests or lhotse cut files (or --validate_only true)")
    check_data_paths(data_args)
    trust = getattr(args, "trust_remote_code", ModelSettings.trust_remote_code)
    check_remote_code(args.target_name_or_path, bool(trust))
    check_run_dirs(args)


# The target directory's files whose `auto_map` names code shipped with it (model, processor, tokenizer).
REMOTE_CODE_CONFIGS = ("config.json", "processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


def check_remote_code(target: str, trusted: bool) -> None:
    """A target directory whose config.json (or processor / tokenizer config) has an `auto_map` ships its own code,
    which loading it would run in this process: refused unless `--trust_remote_code true`."""
    for name in REMOTE_CODE_CONFIGS:
        config = Path(target).expanduser() / name
        if not config.is_file():
            continue
        try:
            raw = json.loads(config.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ValueError(f"--target_name_or_path {target}: {config} is not readable JSON ({err})") from err
        auto_map = raw.get("auto_map") if isinstance(raw, dict) else None
        if auto_map and not trusted:
            names = ", ".join(sorted(auto_map)) if isinstance(auto_map, dict) else str(auto_map)
            raise ValueError(
                f"--target_name_or_path {target}: its {name} has an auto_map ({names}), code of its own that "
                "loading it would run; pass --trust_remote_code true only if you trust that directory's code, else "
                "use a target that transformers implements"
            )


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


__all__ = ["REMOTE_CODE_CONFIGS", "check_remote_code", "check_resume_path", "check_run_dirs", "check_run_inputs"]
