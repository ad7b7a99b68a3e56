"""Kernels shared by training and decoding: torch's CPU threads, CUDA-graph capture with an eager fallback, FP8
draft linears and the fused lm_head + cross-entropy. Public names are imported on first use (`dflash_hf.lazy`)."""

from dflash_hf.lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".cpu_threads": ["configure_cpu_threads"],
        ".cuda_graphs": ["capture_graph"],
        ".float8": ["Float8Linear", "float8_draft_linears"],
        ".fused_ce": ["fused_lm_head_ce"],
    },
)
