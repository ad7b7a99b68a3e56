"""Tiny random targets for tests and the demo (`tiny`): an in-process byte-level tokenizer, text, Qwen3-ASR and
Whisper targets built from configs, synthetic speech; the demo's assets, a tiny target taught to transcribe synthetic
speech (`demo_assets`); nothing is downloaded. Public names are imported on first use (`dflash_hf.lazy`)."""

from dflash_hf.lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".demo_assets": ["DemoAssets", "build_demo_assets", "replayed_epochs", "teach_target"],
        ".tiny": [
            "build_qwen3_asr_target",
            "build_text_target",
            "build_tokenizer",
            "build_whisper_target",
            "save_tiny_target",
            "synthesize_speech",
        ],
    },
)
