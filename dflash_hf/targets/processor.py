"""Where a target's files come from: a model given as a local directory or a Hub id (`check_model_dir`), whose own code
runs only when trusted (`check_remote_code`), its processor or tokenizer (`load_processor`), and the model with its
processor as `dflash-generate-labels` decodes with them (`load_label_target`). Light at import: transformers loads when
a function runs."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_hf.settings import ModelSettings


def check_model_dir(name: str, field: str, what: str) -> None:
    """A model given as a local path must be an existing directory (a Hub id is left to transformers)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    path = Path(name).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise NotADirectoryError(f"{field}={name} is a file; give the directory of {what} (its save_pretrained)")
    try:
        validate_repo_id(name)
        looks_local = name.startswith((".", "~")) or Path(name).is_absolute()
    except HFValidationError:
        looks_local = True
    if looks_local:
        raise FileNotFoundError(
            f"{field}={name}: the directory does not exist; give the directory of {what} "
            "(a model saved with save_pretrained) or a Hub model id"
        )


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


def load_processor(path: str, trust_remote_code: bool = ModelSettings.trust_remote_code):
    """The target's processor (audio targets) or tokenizer (text targets), from its directory."""
    from transformers import AutoProcessor, AutoTokenizer

    kwargs = {"trust_remote_code": True} if trust_remote_code else {}
    try:
        return AutoProcessor.from_pretrained(path, **kwargs)
    except (OSError, ValueError, TypeError):
        return AutoTokenizer.from_pretrained(path, **kwargs)


def label_target_family(path: str, family: str | None):
    """`(config, family row)` of the target at `path` from its config alone (no weights load): the family named by
    `family`, or the config's own (None)."""
    from transformers import AutoConfig

    from dflash_hf.targets.families.registry import resolve_family

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"field 'model': {path!r} has no config transformers can read ({e}); give a saved model"
        ) from None
    return config, resolve_family(config, family)


def load_label_target(path: str, family: str | None, dtype: str, device: str, resolved: tuple | None = None):
    """`(model, processor, family)` of the target at `path` for greedy decoding (`dflash-generate-labels`): the model
    class its config names (a causal LM for a text target) in `dtype` (a torch dtype name) on `device`, in eval mode;
    an audio target's processor with the exact, faster Whisper log-mel (`with_fast_features`), a text target's
    tokenizer. `family`: the family row name (None: from the config); `resolved`: `label_target_family(path, family)`
    when the caller has it already (`check_label_inputs` returns it). A checkpoint missing parameters is refused."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoProcessor, AutoTokenizer

    from dflash_hf.targets.families.whisper_features import with_fast_features
    from dflash_hf.targets.frozen import check_complete

    config, fam = resolved if resolved is not None else label_target_family(path, family)
    torch_dtype = getattr(torch, dtype)
    if fam.has_audio:
        processor = with_fast_features(AutoProcessor.from_pretrained(path))  # exact, faster Whisper log-mel
        arch = (config.architectures or [None])[0]
        if arch is None or not hasattr(transformers, arch):
            raise ValueError(f"{path}: config.architectures={config.architectures} names no transformers class")
        model_class = getattr(transformers, arch)
    else:
        processor = AutoTokenizer.from_pretrained(path)
        model_class = AutoModelForCausalLM
    model, info = model_class.from_pretrained(path, dtype=torch_dtype, output_loading_info=True)
    check_complete(path, info, "--model")
    return model.to(device).eval(), processor, fam


__all__ = [
    "REMOTE_CODE_CONFIGS",
    "check_model_dir",
    "check_remote_code",
    "label_target_family",
    "load_label_target",
    "load_processor",
]
