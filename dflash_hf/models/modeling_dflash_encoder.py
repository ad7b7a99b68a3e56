"""Encoder context for drafts of encoder-decoder targets (Whisper): an opt-in OUTSIDE the published DFlash contract.

With `dflash_config.encoder_hidden_size` set (`--draft_encoder_context`), every draft layer gains a cross-attention
sublayer from the block slots to the target encoder's output frames, between its self-attention and its MLP, laid
out as Whisper's own decoder cross-attention (pre-LayerNorm; biased q, v and output projections, k without bias;
no RoPE: the frames carry the encoder's positions). The draft then reads the audio directly instead of only
through the tapped decoder states. Engines that implement the published contract cannot serve such a draft; the
export's config and model card say so. The frames' keys and values are computed once per utterance
(inside each layer's forward, kept in the `encoder_cache` the decoder passes) and reused by every decoding cycle.

Remote-code safe: imports only torch and `configuration_dflash`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_dflash import DFlashConfig

EncoderKV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [b, heads, F, head_dim] each


class DFlashEncoderAttention(nn.Module):
    """Block slots attend to every encoder frame of their utterance (no mask: one utterance per row)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        inner, h = self.num_heads * self.head_dim, config.hidden_size
        self.layer_norm = nn.LayerNorm(h)
        self.q_proj = nn.Linear(h, inner)
        self.k_proj = nn.Linear(config.encoder_hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(config.encoder_hidden_size, inner)
        self.o_proj = nn.Linear(inner, h)

    def key_values(self, frames: torch.Tensor) -> EncoderKV:
        """Encoder frames `[b, F, E]` -> keys and values `[b, heads, F, head_dim]`."""
        b, f, _ = frames.shape
        frames = frames.to(self.k_proj.weight.dtype)
        k = self.k_proj(frames).view(b, f, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(frames).view(b, f, self.num_heads, self.head_dim).transpose(1, 2)
        return k, v

    def forward(self, hidden: torch.Tensor, key_values: EncoderKV) -> torch.Tensor:
        """`hidden` `[b, Q, H]` (the residual stream) -> the sublayer's output `[b, Q, H]` (added by the caller)."""
        b, q_len, _ = hidden.shape
        q = self.q_proj(self.layer_norm(hidden)).view(b, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = key_values
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype))  # [b, heads, Q, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


@torch.no_grad()
def copy_cross_attention(module: DFlashEncoderAttention, source: nn.Module, layer_norm: nn.Module) -> None:
    """Initialize from a Whisper-style decoder cross-attention (`q_proj`/`k_proj`/`v_proj`/`out_proj`, the k bias
    absent or zero) and its LayerNorm. Shapes must match; raises a ValueError naming the tensor otherwise."""
    pairs = [(module.layer_norm.weight, layer_norm.weight), (module.layer_norm.bias, layer_norm.bias)]
    projections = ((module.q_proj, source.q_proj), (module.v_proj, source.v_proj), (module.o_proj, source.out_proj))
    for mine, theirs in projections:
        pairs += [(mine.weight, theirs.weight), (mine.bias, theirs.bias)]
    pairs.append((module.k_proj.weight, source.k_proj.weight))
    if getattr(source.k_proj, "bias", None) is not None and bool(source.k_proj.bias.any()):
        raise ValueError("the target's cross-attention k_proj has a non-zero bias, which the draft's has not")
    for mine, theirs in pairs:
        if mine.shape != theirs.shape:
            raise ValueError(
                f"encoder-context init: draft tensor of shape {tuple(mine.shape)} cannot take the "
                f"target's {tuple(theirs.shape)}; the draft's attention heads x head_dim must equal "
                "the target decoder's width"
            )
        mine.copy_(theirs.to(mine.dtype))


__all__ = ["DFlashEncoderAttention", "EncoderKV", "copy_cross_attention"]
