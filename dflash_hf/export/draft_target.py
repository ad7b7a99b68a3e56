"""Whether a draft export was trained for a given target (`dflash-eval`): its vocabulary (the warm start's check,
`targets.draft_checks.vocab_difference`) and the target's weights fingerprint its run record holds (`dflash_run.json`,
written beside every export by `dflash-train`: `run_record.target_identity`). The hidden size and the taps are checked
by `FrozenTarget.validate` (`draft_on_target`): a draft of another size cannot run against the target at all."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from dflash_hf.errors import DFlashUserError
from dflash_hf.export.drafts import resolve_draft_dir
from dflash_hf.export.run_record import RUN_RECORD, read_record, target_identity
from dflash_hf.targets.draft_checks import vocab_difference
from dflash_hf.targets.frozen import FrozenTarget

logger = logging.getLogger("dflash_hf")


def draft_on_target(draft: nn.Module, target: FrozenTarget, dtype: torch.dtype) -> nn.Module:
    """`draft` on the target's device in `dtype`, in eval mode, checked against the target: its mask id, tapped
    layers and hidden size (`FrozenTarget.validate`)."""
    draft = draft.to(device=target.device, dtype=dtype).eval()
    cfg = draft.config
    target.validate(mask_token_id=cfg.mask_token_id, target_layer_ids=cfg.target_layer_ids, hidden_size=cfg.hidden_size)
    return draft


def draft_target_check(draft: str, config, target: FrozenTarget) -> dict[str, Any]:
    """`recorded_fingerprint` (the export's run record; None when it has none), `target_fingerprint` (the given
    target's) and `differences` (each a sentence; empty when the draft was trained for this target)."""
    differences = []
    vocabulary = vocab_difference(config, target.vocab_size)
    if vocabulary:
        differences.append(f"the draft {vocabulary}")
    record = read_record(resolve_draft_dir(draft)) or {}
    recorded = ((record.get("settings") or {}).get("target") or {}).get("fingerprint")
    given = target_identity(target.model)["fingerprint"]
    if recorded and recorded != given:
        differences.append(
            f"its run record ({RUN_RECORD}) names a target with weights fingerprint {recorded}, the given target's is "
            f"{given} (another model, or other weights of the same shapes)"
        )
    return {"recorded_fingerprint": recorded, "target_fingerprint": given, "differences": differences}


def check_draft_target(draft: str, config, target: FrozenTarget, *, allow_mismatch: bool, target_name: str) -> dict:
    """`draft_target_check`, refused (a user error) when there is a difference, unless `allow_mismatch`: then
    warned and returned with `allowed: True`, for the results to record."""
    check = draft_target_check(draft, config, target)
    if check["differences"] and not allow_mismatch:
        raise DFlashUserError(
            f"--draft {draft} was not trained for --target {target_name}: {'; '.join(check['differences'])}. "
            "Evaluate it against the target it was trained for, or pass --allow_target_mismatch true to compare "
            "deliberately (the differences are recorded in the results)"
        )
    if check["differences"]:
        logger.warning("--allow_target_mismatch: %s", "; ".join(check["differences"]))
    return check | {"allowed": bool(check["differences"])}


__all__ = ["check_draft_target", "draft_on_target", "draft_target_check"]
