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

import torch
from torch import nn

from dflash_hf.targets.builder import draft_class_for

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


def _fresh_copy(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """A CPU copy of `model` (a draft or its LoRA `PeftModel`) holding `state_dict`, built from the config,
    so it works for parameter-sharded (FSDP) models whose own tensors are only shards."""
    peft = is_peft_model(model)
    base = model.get_base_model() if peft else model
    config = copy.deepcopy(base.config)
    fresh = draft_class_for(config)(config)
    if peft:
        fresh = peft_model(fresh, copy.deepcopy(model.peft_config[model.active_adapter]))
    dtype = next(t.dtype for t in state_dict.values() if t.is_floating_point())
    fresh.to(dtype).load_state_dict(state_dict, strict=True)
    return fresh


def plain_draft(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """The plain draft to export from `model` (a draft or its LoRA `PeftModel`, merged on a copy); `state_dict`: the
    model's full state dict gathered elsewhere (FSDP), used instead of its own tensors."""
    return merged_draft(model if state_dict is None else _fresh_copy(model, state_dict))


__all__ = [
    "apply_adaptation",
    "check_resume_selection",
    "merged_draft",
    "plain_draft",
    "peft_model",
    "save_selection",
    "trainable_selection",
]
