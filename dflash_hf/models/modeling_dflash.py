"""DFlash block-diffusion drafts (Qwen3-style decoder layers reading frozen target features).

Remote-code safe: imports only torch, transformers, `configuration_dflash` and `modeling_dflash_encoder` (the
encoder-context opt-in for encoder-decoder targets, outside the published contract).

A draft predicts a *block* of `B` tokens in one forward: slot 0 holds the anchor token (the last
verified token), slots 1..B-1 hold the mask token and predict the tokens at the same positions.
Every draft layer attends from the block slots to `[ctx ; block]`, where `ctx` is the projection of
the concatenated target taps (`hidden_norm(fc(taps))`), shared by all layers.

Attention backend follows the mask type: a FlexAttention `BlockMask` runs `flex_attention`, a dense
boolean tensor (True = may attend) or `None` (every slot sees everything given) runs SDPA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer

from .configuration_dflash import DFlashConfig
from .modeling_dflash_encoder import DFlashEncoderAttention

try:  # FlexAttention is optional (torch >= 2.6: BlockMask seq_lengths)
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
        # Default dynamism: the second shape compiles a dynamic-shape kernel that serves every later one. With
        # `dynamic=False` each new (sequence, anchors) shape recompiled, and past dynamo's recompile limit flex
        # silently ran eagerly (the full score matrix materialized: slow, and out of memory on long rows).
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)


class DFlashRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) in float32, then the weight in x's dtype (Qwen3's RMSNorm). On CUDA `F.rms_norm`
        # runs torch's fused kernel (`_fused_rms_norm`) where the written-out formula launches five; on the CPU it
        # runs that formula's operators, bit for bit (tests/generation/test_verification_ops.py)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.variance_epsilon)
        return self.weight * normed.to(x.dtype)


class DFlashRotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE. `inv_freq` is float32 whatever the draft's dtype (kept per device, not a buffer), so
    casting the draft to bf16 can never dephase positions (a bf16 `inv_freq` buffer drifts with position)."""

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

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The float32 inverse frequencies on `device`, computed at the first use there and kept (an attribute, not
        a buffer: casting the module leaves them float32, and no checkpoint holds them), so a decoding cycle does not
        recompute them."""
        cached = self.__dict__.setdefault("_inv_freq", {})
        key = (device, self.rope_theta, self.head_dim)  # settings in the key: a changed setting is never stale
        kept = cached.get(key)
        if kept is None or kept.device != device:  # (a whole-module pickle loaded elsewhere moves the tensor)
            with torch.no_grad():
                exponent = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
                kept = cached[key] = 1.0 / (self.rope_theta ** (exponent / self.head_dim))
        return kept

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: [b, T] -> cos, sin: [b, T, head_dim]
        freqs = position_ids.float()[..., None] * self.inv_freq(position_ids.device)
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
    """Pre-norm Qwen3-style layer; DFlash2 subclasses wrap both sublayers with convolutions. With the encoder-context
    opt-in, a cross-attention sublayer to the encoder frames sits between self-attention and MLP."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.encoder_attn = DFlashEncoderAttention(config) if config.encoder_context else None
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def attend_encoder(self, hidden: torch.Tensor, frames: torch.Tensor | None, cache: dict | None) -> torch.Tensor:
        """The encoder-context sublayer (identity without it). The frames' keys/values are computed here, inside the
        layer's own forward (so a sharded layer holds its full weights), and kept in `cache` when one is given."""
        if self.encoder_attn is None:
            return hidden
        idx = self.self_attn.layer_idx
        kv = cache.get(idx) if cache is not None else None
        if kv is None:
            kv = self.encoder_attn.key_values(frames)
            if cache is not None:
                cache[idx] = kv
        return hidden + self.encoder_attn(hidden, kv)

    def forward(
        self, hidden, ctx, cos, sin, attention_mask=None, past_key_values=None, encoder_frames=None, encoder_cache=None
    ):
        x = self.input_layernorm(hidden)
        hidden = hidden + self.self_attn(x, ctx, cos, sin, attention_mask, past_key_values)
        hidden = self.attend_encoder(hidden, encoder_frames, encoder_cache)
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
        encoder_hidden_states: torch.Tensor | None = None,  # [b, F, E] encoder frames (encoder-context drafts)
        encoder_cache: dict | None = None,  # per-utterance cache of the frames' keys/values (decoding: pass {} once)
        **kwargs,
    ) -> torch.Tensor:
        """Returns the final-normed draft hidden `[b, Q, H]` of the block slots."""
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlash draft forward needs `noise_embedding` and `target_hidden`")
        if (encoder_hidden_states is not None) != self.config.encoder_context:
            raise ValueError(
                "an encoder-context draft (dflash_config.encoder_hidden_size set) needs `encoder_hidden_states`; a "
                "draft without encoder context takes none"
            )
        if encoder_hidden_states is not None and encoder_hidden_states.shape[0] != noise_embedding.shape[0]:
            raise ValueError(
                f"encoder_hidden_states has {encoder_hidden_states.shape[0]} rows but the block has "
                f"{noise_embedding.shape[0]}: one utterance's frames per row"
            )
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
            hidden = layer(hidden, ctx, cos, sin, attention_mask, past_key_values, encoder_hidden_states, encoder_cache)
        return self.norm(hidden)


# --------------------------------------------------------------------------------------------
# DFlash2: two-tap grouped dynamic convolutions around both sublayers and a top-k path selector
# --------------------------------------------------------------------------------------------
class DFlash2DynamicConv(nn.Module):
    """Grouped dynamic convolution over the slots of each block, wrapped around one sublayer.

    With `s = 0` before and `s = 1` after the sublayer, K = `conv_kernel_size`, G = `conv_group_size`:
    `out[t, c] = sum_o (base_kernel[s, o, c] + delta[t, s, o, c // G]) * x[t - o, c]`, where tap `o` reads
    slot `t - o` of the SAME block (zeros before slot 0) and `delta = kernel_projection(sublayer input)`
    viewed as `[2, K, H // G]`. Slots are laid out as contiguous blocks of `config.block_size`
    (N*B slots in training, B at inference), so block boundaries follow from the slot index.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        dc = config.dflash_config
        self.config = config
        self.kernel_size = dc["conv_kernel_size"]
        self.group_size = dc["conv_group_size"]
        self.num_groups = config.hidden_size // self.group_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.kernel_size, config.hidden_size))
        self.kernel_projection = nn.Linear(config.hidden_size, 2 * self.kernel_size * self.num_groups, bias=False)

    def _convolve(self, x: torch.Tensor, side: int, delta: torch.Tensor) -> torch.Tensor:
        # x: [b, Q, H]; delta: [b, Q, K, groups] dynamic coefficients of this side -> [b, Q, H]
        b, q, h = x.shape
        bs = self.config.block_size
        if q % bs:
            raise ValueError(f"DFlash2 convolution got {q} slots, not a multiple of block_size {bs}: pass whole blocks")
        xb = x.view(b, q // bs, bs, h)  # [b, n, B, H]
        db = delta.view(b, q // bs, bs, self.kernel_size, self.num_groups, 1)
        out = None
        for o in range(min(self.kernel_size, bs)):  # taps at or past the block start read only zeros
            # [b, n, B, H]: slot t holds x[t - o], zeros for t < o (tap 0 is x itself: no padding copy)
            tap = F.pad(xb[:, :, : bs - o], (0, 0, o, 0)) if o else xb
            dyn = (tap.view(b, q // bs, bs, self.num_groups, self.group_size) * db[..., o, :, :]).view_as(tap)
            term = tap * self.base_kernel[side, o] + dyn
            out = term if out is None else out + term  # (not sum(): its start 0 is one more operator)
        return out.view(b, q, h)

    def forward(self, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`post(sublayer(pre(x)))` for the normed sublayer input `x` `[b, Q, H]`."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.num_groups)
        y = sublayer(self._convolve(x, 0, delta[..., 0, :, :]))
        return self._convolve(y, 1, delta[..., 1, :, :])


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """`x -> input_norm -> conv.pre -> self_attn -> conv.post -> +residual`, the same around the MLP."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.attention_conv = DFlash2DynamicConv(config)
        self.mlp_conv = DFlash2DynamicConv(config)

    def forward(
        self, hidden, ctx, cos, sin, attention_mask=None, past_key_values=None, encoder_frames=None, encoder_cache=None
    ):
        x = self.input_layernorm(hidden)
        hidden = hidden + self.attention_conv(
            x, lambda y: self.self_attn(y, ctx, cos, sin, attention_mask, past_key_values)
        )
        hidden = self.attend_encoder(hidden, encoder_frames, encoder_cache)
        return hidden + self.mlp_conv(self.post_attention_layernorm(hidden), self.mlp)


class DFlash2CandidateSelector(nn.Module):
    """Rank-r path selector over the top-k candidates of each slot.

    `S_t(a, b) = U_t(b) + <A[a] * H(h_t), B[b]>`: U the draft logit of candidate b, a the token at the
    previous slot (the anchor for slot 1), A / B the predecessor / successor codebooks `[V, r]`,
    H = `hidden_projection`.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        rank = config.dflash_config["selector_rank"]
        self.top_k = config.dflash_config["selector_top_k"]
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,  # [..., H] final-normed draft hidden of the slots
        unary: torch.Tensor,  # [..., k] draft logits of the candidates
        candidates: torch.LongTensor,  # [..., k] candidate token ids
        predecessors: torch.LongTensor | int,  # [...] token at the previous slot (an int: one slot)
    ) -> torch.Tensor:
        """Pair scores `[..., k]` in float32."""
        dtype = self.predecessor_codebook.dtype
        query = self.predecessor_codebook[predecessors] * self.hidden_projection(hidden.to(dtype))  # [..., r]
        pair = torch.einsum("...r,...kr->...k", query, self.successor_codebook[candidates])
        return unary.float() + pair.float()

    def transition_table(
        self,
        hidden: torch.Tensor,  # [n, H] final-normed draft hidden of slots 1..n
        unary: torch.Tensor,  # [n, k] draft logits of the candidates
        candidates: torch.LongTensor,  # [n, k] candidate token ids
        anchor_token: int | torch.Tensor,
    ) -> torch.Tensor:
        """`forward` for every (predecessor candidate, candidate) pair of every slot in one batch: `[n, k, k]`
        float32, entry `[s, i, j]` the score of candidate j of slot s after candidate i of slot s-1. Slot 0's
        predecessor is the anchor (a host int, or a 0-d device tensor inside a CUDA graph), so its k rows are the
        anchor's scores (read row 0)."""
        dtype = self.predecessor_codebook.dtype
        if isinstance(anchor_token, torch.Tensor):  # [n, k]: anchor row, then slots
            first = anchor_token.to(candidates.dtype).view(1, 1).expand(1, candidates.shape[1])
            predecessors = torch.cat([first, candidates[:-1]])
        else:
            predecessors = F.pad(candidates[:-1], (0, 0, 1, 0), value=anchor_token)
        query = self.predecessor_codebook[predecessors] * self.hidden_projection(hidden.to(dtype))[:, None]
        pair = query @ self.successor_codebook[candidates].transpose(-1, -2)  # [n, k, r] @ [n, r, k]
        return unary.float()[:, None] + pair.float()


def _greedy_walk(best: torch.LongTensor) -> torch.LongTensor:
    """Choices `[n]` of the walk `c_0 = best[0, 0]`, `c_s = best[s, c_{s-1}]`, for `best` `[n, k]` (slot s's best
    candidate after each candidate of slot s-1), on `best`'s device.

    Each row is a map of the k candidate indices; the walk is the prefix composition of those maps, done as a
    Hillis-Steele scan: ceil(log2 n) rounds of one gather and one cat (8 kernels at block 16, instead of a
    chained index per slot), with no host sync. A host walk would copy `best` to the host, which waits for the
    draft forward still in flight, so the target's verify forward could not be queued behind it."""
    walk, step = best, 1
    while step < walk.shape[0]:  # walk[s] = best[s] o best[s-1] o ... o best[max(0, s - 2 * step + 1)]
        walk = torch.cat([walk[:step], walk[step:].gather(1, walk[:-step])])
        step *= 2
    return walk[:, 0]


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 draft: DFlash plus per-layer dynamic convolutions (`attention_conv`, `mlp_conv`) and a
    `candidate_selector`. Fresh weights are the identity convolution and a zero successor codebook, so
    a fresh DFlash2 draft computes exactly the hidden states (and greedy proposals) of DFlash."""

    layer_class = DFlash2DecoderLayer
    _no_split_modules = ["DFlash2DecoderLayer"]

    def __init__(self, config: DFlashConfig):
        config.check_dflash2()  # shape preconditions, before any weight is allocated
        super().__init__(config)  # builds (and initializes) the DFlash2 layers
        self.candidate_selector = DFlash2CandidateSelector(config)
        self.post_init()  # initializes only the selector: modules already initialized are skipped

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # `transformers.initialization` functions skip tensors loaded by from_pretrained.
        if isinstance(module, DFlash2DynamicConv):
            identity = torch.zeros_like(module.base_kernel)
            identity[:, 0] = 1.0
            init.copy_(module.base_kernel, identity)
            init.zeros_(module.kernel_projection.weight)
        elif isinstance(module, DFlash2CandidateSelector):
            init.normal_(module.predecessor_codebook, mean=0.0, std=0.02)
            init.zeros_(module.successor_codebook)
        else:
            super()._init_weights(module)

    @torch.no_grad()
    def propose_block(
        self,
        hidden: torch.Tensor,  # [B, H] final-normed draft hidden of one block
        lm_head: nn.Module,  # the target's frozen lm_head
        anchor_token: int | torch.Tensor,  # a 0-d device tensor only when greedy
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Selector walk over the top-k candidates of slots 1..B-1.

        Greedy (`temperature <= 0`): each slot takes the best-scoring candidate given the token chosen
        at the previous slot; returns `(tokens [B-1], None)`. The scores of all slots come from one batched
        `transition_table` and the walk runs on device (`_greedy_walk`), a fixed number of kernels instead of
        B-1 sequential rounds. It equals the slot-by-slot walk over `forward` (tests/models/test_dflash2_walk.py)
        up to rounding: batched and per-vector matmuls may round differently at the last place, which can only
        flip a choice between near-tied candidates (none in the float32 and bf16 checks on CPU; a GPU's bf16
        kernels may differ). Decoded output is unchanged either way: verification decides the tokens.

        Sampling: each slot samples from `softmax(S / temperature)` over its candidates given the sampled
        predecessor, and returns that conditional proposal as a full-vocabulary distribution `q [B-1, V]` (zero
        outside the candidates), so rejection sampling against the target stays lossless.
        """
        selector = self.candidate_selector
        logits = lm_head(hidden[1:]).float()  # [B-1, V]
        unary, candidates = logits.topk(selector.top_k, dim=-1)  # [B-1, k]
        if temperature <= 0:
            best = selector.transition_table(hidden[1:], unary, candidates, anchor_token).argmax(-1)  # [B-1, k]
            return candidates.gather(1, _greedy_walk(best)[:, None]).squeeze(1), None
        q = logits.new_zeros(logits.shape)
        prev = anchor_token  # an int indexes the codebook as the 0-d tensor would, without a host-to-device copy
        tokens = []
        for slot in range(logits.shape[0]):
            scores = selector(hidden[1 + slot], unary[slot], candidates[slot], prev)  # [k]
            probs = torch.softmax(scores / temperature, dim=-1)
            choice = torch.multinomial(probs, 1, generator=generator)[0]
            q[slot, candidates[slot]] = probs
            prev = candidates[slot, choice]
            tokens.append(prev)
        return (torch.stack(tokens) if tokens else candidates[:, 0]), q  # a block of the anchor alone: nothing


DFlashDraftModel.register_for_auto_class("AutoModel")
DFlash2DraftModel.register_for_auto_class("AutoModel")
DFlashConfig.register_for_auto_class()

__all__ = [
    "DFlashDraftModel",
    "DFlash2DraftModel",
    "DFlashPreTrainedModel",
    "DFlashDecoderLayer",
    "DFlash2DecoderLayer",
    "DFlash2DynamicConv",
    "DFlash2CandidateSelector",
    "DFlashAttention",
]
