"""The frozen target's decoder masks built on the device, so that its training forward reads nothing back to the host.

transformers' mask helpers read the 2D padding mask (or, without one, the position ids) on the host to decide
whether a batch needs a mask at all: a device synchronize per micro-batch, and a forward that a CUDA graph cannot
capture. Where the trainer's CPU plan already knows the answer, these give the decoder the same mask, or none,
without the read (`FrozenTarget.target_inputs`; checked bit for bit in tests/targets/test_target_masks.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import masking_utils

# Decoder model types whose mask is transformers' causal-plus-padding mask and nothing else (with full attention in
# every layer), so that a prebuilt 4D mask gives the same taps (checked in tests/targets/test_target_masks.py);
# others build their own masks (sliding windows, hybrid recurrent layers) and keep transformers' path.
PREBUILT_MASK_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "whisper"})
# Attention implementations that build per-document masks from `position_ids` restarts in transformers 5.x
# (masking_utils.find_packed_sequence_indices for sdpa/eager/flex, varlen kernels for flash).
PACKED_ATTN_IMPLEMENTATIONS = (
    "sdpa",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)


def check_packing(decoder_config) -> None:
    """Refuse packed batches when the decoder's attention implementation cannot isolate documents."""
    impl = getattr(decoder_config, "_attn_implementation", None)
    if impl not in PACKED_ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"packing=True needs a target attn_implementation that keeps packed documents apart via "
            f"position_ids; the target's decoder uses {impl!r}. Load the target with attn_implementation in "
            f"{list(PACKED_ATTN_IMPLEMENTATIONS)} (CPU: 'sdpa'), or set packing=False"
        )


def padded_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The decoder's 4D boolean mask `[b, 1, S, S]` of a padded batch, causal and over real keys, as transformers'
    sdpa mask of that batch (built on the device, with no host read of the 2D mask `[b, S]`)."""
    s = attention_mask.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    return causal[None, None] & attention_mask.bool()[:, None, None, :]


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The 4D boolean mask `[1, 1, T, T]` of a packed row `position_ids` `[1, T]`: causal within each run of
    consecutive positions (transformers' packed-sequence segments), built on the device."""
    segment = (torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    causal = torch.ones(
        position_ids.shape[-1], position_ids.shape[-1], dtype=torch.bool, device=position_ids.device
    ).tril()
    return (segment[:, None, :, None] == segment[:, None, None, :]) & causal


def one_document_filling(batch: dict) -> bool:
    """Whether a packed row (`cu_seqlens`, `max_seqlen`, `position_ids`) holds one document and no padding: known on
    the host, it needs no mask."""
    max_seqlen = batch.get("max_seqlen")
    return (
        isinstance(max_seqlen, int)
        and batch["cu_seqlens"].numel() == 2
        and max_seqlen == batch["position_ids"].shape[-1]
    )


def _one_sequence_per_row(position_ids: torch.Tensor) -> None:
    return None


def _tracing_unless_capturing(is_tracing):
    """transformers' `is_tracing` that, asked about no tensor, does not count a CUDA stream capture as tracing."""

    def tracing(tensor=None) -> bool:
        if tensor is None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return torch.compiler.is_compiling()
        return is_tracing(tensor)

    return tracing


@contextmanager
def without_packed_detection():
    """Within the block, transformers' mask helpers treat a forward given no 2D mask as one sequence per row (as
    `find_packed_sequence_indices` concludes after reading the positions on the host): for a batch that the host
    knows has neither padding nor packed documents, the decoder then takes SDPA's `is_causal` path, as it does after
    reading an all-ones mask, with no read at all. The same holds while the forward is captured as a CUDA graph
    (`target_graph`): transformers 5.17 builds an explicit causal mask whenever a stream is being captured, even with
    no padding mask to read (a different attention kernel: not the eager forward's numbers). The patch is
    process-wide while the block runs (a forward of the same process in another thread would see it); a helper that
    a transformers version lacks is left alone (the forward is then transformers' own, with its host reads)."""
    patches = {
        "find_packed_sequence_indices": lambda original: _one_sequence_per_row,
        "is_tracing": _tracing_unless_capturing,
    }
    originals = {name: getattr(masking_utils, name) for name in patches if hasattr(masking_utils, name)}
    for name, original in originals.items():
        setattr(masking_utils, name, patches[name](original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(masking_utils, name, original)


__all__ = [
    "PACKED_ATTN_IMPLEMENTATIONS",
    "PREBUILT_MASK_MODEL_TYPES",
    "check_packing",
    "one_document_filling",
    "packed_causal_mask",
    "padded_causal_mask",
    "without_packed_detection",
]
