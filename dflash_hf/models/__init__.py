"""The draft models: remote code, copied into every export (`configuration_dflash.py`, `modeling_dflash.py` and the
sibling files they import; this `__init__` is not copied). Public names are imported on first use
(`dflash_hf.lazy`), so reading `draft_fields` (the settings do) loads no torch."""

from dflash_hf.lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".configuration_dflash": ["DFlashConfig"],
        ".draft_fields": ["DFlash2Fields"],
        ".modeling_dflash": ["DFlash2DraftModel", "DFlashDraftModel"],
    },
)
