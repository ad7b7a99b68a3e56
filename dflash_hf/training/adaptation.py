"""Adapting a warm-started draft: projection-only parameter filter, LoRA through `peft`, merge for export.

- `projection_only`: only `fc.weight` (the tap projection) is trainable; the rest of the draft is frozen
  but still differentiated through, so gradients reach `fc`.
- `lora_r > 0`: `peft` LoRA adapters on the draft's linear layers; the base draft is frozen. Exports
  merge the adapters (`merge_and_unload`) so the published checkpoint is a plain draft.

The trainable selection is recorded in every Trainer checkpoint (`SELECTION_FILE`) so that resuming
with a different selection fails with a clear message instead of inside the optimizer load.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

from torch import nn

from dflash_hf.training.argument_groups import DEFAULT_LORA_TARGETS, LORA_TARGETS

PROJECTION_PARAM = "fc.weight"
SELECTION_FILE = "dflash_trainable.json"


def is_peft_model(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def apply_adaptation(model: nn.Module, args) -> nn.Module:
    """Apply `args.projection_only` (a requires_grad filter) or `args.lora_r` (peft LoRA) to the draft.

    Returns the model the Trainer should hold: the draft itself, or its `PeftModel` wrapper.
    """
    if args.projection_only:
        if PROJECTION_PARAM not in dict(model.named_parameters()):
            raise ValueError(f"projection_only: the draft has no `{PROJECTION_PARAM}` parameter")
        for name, param in model.named_parameters():
            param.requires_grad_(name == PROJECTION_PARAM)
        return model
    if args.lora_r > 0:
        if is_peft_model(model):
            raise ValueError("lora_r > 0 but the model is already a PeftModel; pass the plain draft")
        from peft import LoraConfig

        lora = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            target_modules=list(args.lora_target_modules),
            bias="none",
        )
        return peft_model(model, lora)
    return model


def trainable_selection(model: nn.Module) -> dict:
    """What the optimizer holds: the names of the trainable parameters (and whether LoRA wraps the draft)."""
    names = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return {"lora": is_peft_model(model), "trainable_parameters": names}


def peft_model(model: nn.Module, config) -> nn.Module:
    """`peft.get_peft_model(model, config)`, without the FutureWarning of peft reading the
    `is_gradient_checkpointing` alias that transformers >= 5.23 deprecated (peft's call, not ours)."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return get_peft_model(model, config)


def save_selection(model: nn.Module, checkpoint_dir: str | Path) -> None:
    path = Path(checkpoint_dir) / SELECTION_FILE
    path.write_text(json.dumps(trainable_selection(model), indent=1))


def check_resume_selection(model: nn.Module, checkpoint_dir: str | Path) -> None:
    """Raise if `checkpoint_dir` was written with a different trainable selection than `model` has now."""
    path = Path(checkpoint_dir) / SELECTION_FILE
    if not path.is_file():
        return
    saved = json.loads(path.read_text())
    now = trainable_selection(model)
    if saved == now:
        return

    def describe(sel: dict) -> str:
        names = sel["trainable_parameters"]
        mode = "LoRA" if sel["lora"] else ("projection_only" if names == [PROJECTION_PARAM] else "full draft")
        return f"{mode}, {len(names)} trainable tensors"

    raise ValueError(
        f"cannot resume from {checkpoint_dir}: it was trained with a different trainable-parameter selection "
        f"({describe(saved)}) than this run ({describe(now)}), so its optimizer state does not fit. Resume with "
        "the same projection_only / lora_* settings, or start a new run from its weights (weights only, fresh "
        f"optimizer): init_from_pretrained={checkpoint_dir}, or for a LoRA checkpoint its merged export_draft"
    )


def merged_draft(model: nn.Module) -> nn.Module:
    """The plain draft to export: a LoRA `PeftModel` is merged on a copy (`merge_and_unload`), so the model
    being trained is left untouched; a plain draft is returned as is."""
    if is_peft_model(model):
        return copy.deepcopy(model).merge_and_unload()
    return model


__all__ = [
    "apply_adaptation",
    "check_resume_selection",
    "merged_draft",
    "peft_model",
    "save_selection",
    "trainable_selection",
    "LORA_TARGETS",
    "DEFAULT_LORA_TARGETS",
]
