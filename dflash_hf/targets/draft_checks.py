"""What a draft needs of its frozen target, and what a warm start keeps: the checks `targets.builder` makes once, in
one pass, when it builds a target and its draft (also `dflash-eval`'s check of a trained draft).

- :func:`check_draft`: a draft config against the target: mask id (an embedding row, not pad or eos), taps, hidden
  size, dtype (`FrozenTarget.validate`), and the encoder-context opt-in (`check_encoder_context`).
- :func:`check_warm_start`, :func:`check_warm_start_sizes`: a warm-started export against the settings given (it keeps
  its architecture, taps, mask id and sizes) and against the target's vocabulary.
"""

from __future__ import annotations

import logging

from dflash_hf.models.configuration_dflash import ARCHITECTURES, DFlash2Fields, DFlashConfig
from dflash_hf.targets.frozen import FrozenTarget

logger = logging.getLogger("dflash_hf.export.hub")  # the name the warm-start messages have always been logged under

WARM_START = "init_from_pretrained"


def require_encoder(target: FrozenTarget, what: str) -> int:
    """The width of the target's encoder frames; a ValueError naming `draft_encoder_context` if it has no encoder."""
    if target.encoder_hidden_size is None:
        raise ValueError(
            f"field 'draft_encoder_context': {what}, but the target (family {target.family.name!r}) has "
            "no encoder; the opt-in is for encoder-decoder targets (Whisper): drop the flag or use a "
            "draft without encoder context"
        )
    return target.encoder_hidden_size


def check_encoder_context(config: DFlashConfig, target: FrozenTarget, source: str = "draft") -> None:
    """An encoder-context draft (outside the published contract) needs an encoder-decoder target of its width."""
    if not config.encoder_context:
        return
    require_encoder(target, f"the {source} attends to encoder frames")
    if config.encoder_hidden_size != target.encoder_hidden_size:
        raise ValueError(
            f"dflash_config.encoder_hidden_size is {config.encoder_hidden_size} but the target's "
            f"encoder frames are {target.encoder_hidden_size} wide: the {source} was trained for "
            "another target"
        )


def check_draft(target: FrozenTarget, config: DFlashConfig, source: str = "draft") -> None:
    """Everything a draft of `config` needs of `target`: its mask id, taps, hidden size and dtype
    (`FrozenTarget.validate`) and, for the encoder-context opt-in, the target's encoder width. `source` names the draft
    in the errors ("draft", "init_from_pretrained export")."""
    target.validate(
        mask_token_id=config.mask_token_id, target_layer_ids=config.target_layer_ids, hidden_size=config.hidden_size
    )
    check_encoder_context(config, target, source)


def check_warm_start(
    config: DFlashConfig,
    *,
    variant: str,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    vocab_size: int | None = None,
    source: str = WARM_START,
) -> None:
    """The warm-started draft keeps its architecture, taps and mask id: explicit settings must agree.
    `vocab_size`: the target's embedding rows; a draft trained against another vocabulary is refused."""
    if config.variant != variant:
        raise ValueError(
            f"{source} is a {ARCHITECTURES[config.variant]} but variant={variant!r}; set variant: {config.variant} "
            "(a warm start keeps the saved architecture)"
        )
    if target_layer_ids is not None and list(target_layer_ids) != config.target_layer_ids:
        raise ValueError(
            f"target_layer_ids={list(target_layer_ids)} differs from the warm-started draft's taps "
            f"{config.target_layer_ids}; drop target_layer_ids (fc.weight is tied to the saved taps)"
        )
    if mask_token_id is not None and mask_token_id != config.mask_token_id:
        raise ValueError(
            f"mask_token_id={mask_token_id} differs from the warm-started draft's {config.mask_token_id}; "
            "drop mask_token_id or use the saved one"
        )
    if difference := vocab_difference(config, vocab_size):
        raise ValueError(f"{source} {difference}; warm start from a draft of this target, or train a new draft")


def vocab_difference(config: DFlashConfig, vocab_size: int | None) -> str | None:
    """How the draft's vocabulary differs from the target's embedding rows (warm start, `dflash-eval`), or None."""
    if vocab_size is not None and config.vocab_size != vocab_size:
        return f"was trained against vocab_size {config.vocab_size}, but this target's embedding has {vocab_size} rows"
    return None


def check_warm_start_sizes(
    config: DFlashConfig, given: dict[str, int], defaults: dict[str, int], source: str = WARM_START
) -> None:
    """Draft sizes (`num_draft_layers`, the DFlash2 fields) come from the warm-started export. A value given that
    differs from both the export's and the default is refused (it cannot be honoured); a default that differs
    from the export's is logged as replaced by the export's."""
    saved = {"num_draft_layers": config.num_hidden_layers}
    if config.variant == "dflash2":
        saved.update(DFlash2Fields.of(config.dflash_config).as_dict())
    for name, value in saved.items():
        if name not in given or given[name] == value:
            continue
        if given[name] != defaults.get(name):
            raise ValueError(
                f"{name}={given[name]} differs from the warm-started draft's {value} ({source} keeps "
                f"its architecture); drop {name} or set it to {value}"
            )
        logger.info("%s: %s=%s from the export (not the default %s)", source, name, value, given[name])


__all__ = [
    "check_draft",
    "check_encoder_context",
    "check_warm_start",
    "check_warm_start_sizes",
    "require_encoder",
    "vocab_difference",
]
