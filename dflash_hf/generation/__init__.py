"""Decoding with a draft: the speculative draft/verify loop (`speculative_generate`, and
`dflash_custom_generate` for `generate(custom_generate=...)`), its rules, fixed-shape steps and tree verification,
how one decode runs (`DecodeOptions`), the target's own decoding (the baseline and generated labels) and decoding
evaluation (`decode_benchmark`). Public names are imported on first use (`dflash_hf.lazy`)."""

from dflash_hf.lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".decode_options": ["DecodeOptions"],
        ".decode_state": ["SpeculativeOutput"],
        ".evaluation": ["DecodeStats", "decode_benchmark"],
        ".model_side": ["model_side_greedy"],
        ".speculative": ["DFlashCustomGenerate", "dflash_custom_generate", "speculative_generate"],
        # `target_generate` the function stays in its module: a package attribute of a submodule's name would
        # shadow the submodule
        ".target_generate": ["generate_inputs", "target_generate_new_tokens", "target_transcripts"],
    },
)
