"""Draft exports: writing one (atomically, with its run and training records), loading one strictly, converting
DFlash to DFlash2, the model card and the Hub push, and what `dflash-eval` sets up from an export (the draft on its
target, its recorded conversation). Public names are imported on first use (`dflash_hf.lazy`)."""

from dflash_hf.lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".conversion": ["convert_dflash_to_dflash2"],
        ".draft_target": ["check_draft_target"],
        ".drafts": ["check_draft_export", "export_draft", "load_draft_strict", "resolve_draft_dir"],
        ".evaluation_setup": ["load_evaluation"],
        ".hub": ["DraftCardInfo", "build_model_card", "push_draft_to_hub"],
        ".training_record": ["TrainingRecord", "read_training_record"],
    },
)
