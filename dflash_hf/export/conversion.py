"""The DFlash -> DFlash2 conversion: a DFlash2 draft at its identity init from a DFlash export (the DFlash2 init of
docs/ARCHITECTURE.md), written like any export (`export.drafts.write_atomically`)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from dflash_hf.export.atomic_write import write_atomically
from dflash_hf.export.drafts import load_draft_strict, resolve_draft_dir
from dflash_hf.export.training_record import read_training_record
from dflash_hf.models.configuration_dflash import ARCHITECTURES, DFlash2Fields
from dflash_hf.targets.builder import draft_class_for


def convert_dflash_to_dflash2(
    source: str | Path,
    out_dir: str | Path,
    *,
    seed: int = 0,
    **dflash2_fields: int,
) -> Path:
    """Bootstrap a DFlash2 draft from a DFlash export (the DFlash2 init of docs/ARCHITECTURE.md): every DFlash
    tensor copied unchanged, identity convolutions, zero successor codebook, seeded N(0, 0.02) predecessor
    codebook. `dflash2_fields`: any of `DFlash2Fields` (`conv_kernel_size`, ...; defaults there). The result
    computes exactly the source's hidden states and greedy proposals, is written in the source's float dtype with
    the source's training record, and loads strictly. Returns `out_dir`."""
    source_model = load_draft_strict(source)
    record = read_training_record(resolve_draft_dir(source))
    config = copy.deepcopy(source_model.config)
    if config.variant != "dflash":
        raise ValueError(f"{source} is already a {ARCHITECTURES[config.variant]}; conversion needs a DFlash export")
    config.architectures = [ARCHITECTURES["dflash2"]]
    config.dflash_config.update(DFlash2Fields(**dflash2_fields).as_dict())
    config.validate_dflash()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = draft_class_for(config)(config)
    missing, unexpected = model.load_state_dict(source_model.state_dict(), strict=False)
    new_only = ("attention_conv.", "mlp_conv.", "candidate_selector.")
    foreign = [k for k in missing if not any(part in k for part in new_only)]
    if unexpected or foreign:
        raise ValueError(f"{source}: tensors do not map onto DFlash2 (unexpected {unexpected}, unfilled {foreign})")
    dtype = config.dtype if config.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    model = model.to(dtype)

    def write(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        if record:
            record.write(staging)

    return write_atomically(out_dir, write)


__all__ = ["convert_dflash_to_dflash2"]
