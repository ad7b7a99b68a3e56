"""DFlash block-diffusion drafts (Qwen3-style decoder layers reading frozen target features).

Remote-code safe: imports only torch, transformers and `configuration_dflash`.

A draft predicts a *block* of `B` tokens in one forward: slot 0 holds the anchor token (the last
verified token), slots 1..B-1 hold the mask token and predict the tokens at the same positions.
Every draft layer attends from the block slots to `[ctx ; block]`, where `ctx` is the projection of
the concatenated target taps (`hidden_norm(fc(taps))`), shared by all layers.

Attention backend follows the mask type: a FlexAttention `BlockMask` runs `flex_attention`, a dense
boolean tensor (True = may attend) or `None` (every slot sees everything given) runs SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from .configuration_dflash import DFlashConfig

try:  # FlexAttention is optional (torch >= 2.5)
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - older torch
    BlockMask, flex_attention = None, None

_compiled_flex = None


def _flex(q, k, v, block_mask):
    """Compiled flex_attention on accelerators (eager flex materializes the full score matrix)."""
    global _compiled_flex
    if q.device.type == "cpu":
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)


class DFlashRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class DFlashRotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE. `inv_freq` is recomputed in float32 on use, so casting the draft to
    bf16 can never dephase positions (a bf16 `inv_freq` buffer drifts with position)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"rope_parameters.rope_type={rope_type!r} is not supported by the DFlash draft; "
                "only default RoPE (rope_theta) is implemented"
            )
        self.rope_theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 1e6)))
        self.head_dim = config.head_dim

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: [b, T] -> cos, sin: [b, T, head_dim]
        exponent = torch.arange(0, self.head_dim, 2, device=position_ids.device, dtype=torch.float32)
        inv_freq = 1.0 / (self.rope_theta ** (exponent / self.head_dim))
        freqs = position_ids.float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, T, d]; cos/sin: [b, T, d]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashAttention(nn.Module):
    """Block slots attend to `[ctx ; block]`: q from the block, k/v from context and block."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [b, Q, H] block slots
        ctx: torch.Tensor,  # [b, S, H] context features (S may be 0 with a cache)
        cos: torch.Tensor,  # [b, S+Q, d]
        sin: torch.Tensor,
        attention_mask=None,  # None | bool [b, 1, Q, S_total+Q] | BlockMask
        past_key_values=None,
    ) -> torch.Tensor:
        b, q_len, _ = hidden.shape
        s_len = ctx.shape[1]
        kv_in = torch.cat([ctx, hidden], dim=1)  # [b, S+Q, H]
        q = self.q_norm(self.q_proj(hidden).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, s_len + q_len, self.num_kv_heads, self.head_dim))
        k = k.transpose(1, 2)
        v = self.v_proj(kv_in).view(b, s_len + q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos[:, s_len:], sin[:, s_len:])
        k = apply_rope(k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if BlockMask is not None and isinstance(attention_mask, BlockMask):
            out = _flex(q, k, v, attention_mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim)
        return self.o_proj(out)


class DFlashDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm Qwen3-style layer; DFlash2 subclasses wrap both sublayers with convolutions."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, hidden, ctx, cos, sin, attention_mask=None, past_key_values=None):
        x = self.input_layernorm(hidden)
        hidden = hidden + self.self_attn(x, ctx, cos, sin, attention_mask, past_key_values)
        x = self.post_attention_layernorm(hidden)
        return hidden + self.mlp(x)


class DFlashPreTrainedModel(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = "dflash"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True


class DFlashDraftModel(DFlashPreTrainedModel):
    """DFlash (v1) draft. Holds neither embedding nor lm_head: the caller embeds block ids with the
    target's frozen `embed_tokens` and projects the returned hidden with the target's `lm_head`."""

    layer_class = DFlashDecoderLayer

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        h = config.hidden_size
        self.fc = nn.Linear(config.num_taps * h, h, bias=False)
        self.hidden_norm = DFlashRMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config)
        self.post_init()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Raw concatenated taps `[b, S, n_taps*H]` -> context features `[b, S, H]`."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(
        self,
        position_ids: torch.LongTensor,  # [b, S+Q]: context positions, then slot positions
        attention_mask=None,
        noise_embedding: torch.Tensor | None = None,  # [b, Q, H] embedded block ids
        target_hidden: torch.Tensor | None = None,  # [b, S, n_taps*H] raw concatenated taps
        past_key_values=None,
        use_cache: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """Returns the final-normed draft hidden `[b, Q, H]` of the block slots."""
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlash draft forward needs `noise_embedding` and `target_hidden`")
        if position_ids.shape[-1] != target_hidden.shape[1] + noise_embedding.shape[1]:
            raise ValueError(
                f"position_ids has {position_ids.shape[-1]} positions; expected context "
                f"{target_hidden.shape[1]} + block {noise_embedding.shape[1]}"
            )
        hidden = noise_embedding
        ctx = self.project_context(target_hidden.to(hidden.dtype))
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(hidden.shape[0], -1)
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, ctx, cos, sin, attention_mask, past_key_values)
        return self.norm(hidden)


DFlashDraftModel.register_for_auto_class("AutoModel")
DFlashConfig.register_for_auto_class()

__all__ = ["DFlashDraftModel", "DFlashPreTrainedModel", "DFlashDecoderLayer", "DFlashAttention"]
