"""The frozen target and its draft: loading and checking a target (`FrozenTarget`, `load_target`), building a
checked target-and-draft pair in one pass (`build_target_and_draft`), its processor, its batch forward as a CUDA
graph, and the model families (`families/`). Public names are imported on first use (`dflash_hf.lazy`)."""

from dflash_hf.lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".builder": ["TargetAndDraft", "build_target_and_draft", "load_frozen_target"],
        ".draft_checks": ["check_draft"],
        ".frozen": ["FrozenTarget", "TargetFeatures", "TargetModel", "load_target"],
        ".processor": ["check_model_dir", "label_target_family", "load_label_target", "load_processor"],
    },
)
