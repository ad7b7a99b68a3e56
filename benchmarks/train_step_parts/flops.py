"""Model FLOPs of a step: the draft's (formula) and the target's forward (counted)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from dflash_hf.models.configuration_dflash import DFlashConfig
from dflash_hf.targets.frozen import FrozenTarget


def draft_flops(cfg: DFlashConfig, seq_len: int, batch: int, n_blocks: int, visible_pairs: int, valid_slots: int):
    """Model FLOPs of one draft training step (forward + backward), broken down."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nh, nkv, layers = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    q_tok, s_tok = n_blocks * cfg.block_size, batch * seq_len
    per_layer_block = 2 * q_tok * h * (2 * nh * d + 2 * nkv * d) + 2 * q_tok * 3 * h * i
    per_layer_ctx = 2 * s_tok * h * 2 * nkv * d
    out = {
        "draft_block_matmuls": 3 * layers * per_layer_block,
        "draft_context_kv": 3 * layers * per_layer_ctx,
        "fc": 2 * 2 * s_tok * cfg.num_taps * h * h,
        "attention": 3 * layers * 4 * d * nh * visible_pairs,
        "lm_head": 2 * 2 * valid_slots * h * cfg.vocab_size,
    }
    return out


def target_flops(tcfg, seq_len: int, batch: int, supervised: int) -> dict:
    """Model FLOPs of a decoder-only text target's forward (causal attention) and of the target_argmax labels."""
    h, d, i = tcfg.hidden_size, tcfg.head_dim, tcfg.intermediate_size
    nh, nkv = tcfg.num_attention_heads, tcfg.num_key_value_heads
    tok = batch * seq_len
    per_layer = 2 * tok * h * (2 * nh * d + 2 * nkv * d) + 2 * tok * 3 * h * i
    causal_pairs = batch * seq_len * (seq_len + 1) // 2
    per_layer += 4 * d * nh * causal_pairs
    return {
        "target_forward": tcfg.num_hidden_layers * per_layer,
        "target_argmax_labels": 2 * supervised * h * tcfg.vocab_size,
    }


def target_forward_flops(target: FrozenTarget, batch: dict, layer_ids: list[int]) -> int:
    """FLOPs of one tapped target forward as executed (padding and the audio encoder included), counted by
    `torch.utils.flop_counter` (matmuls, convolutions, attention): for targets without a closed-form count.
    Compiled layers (`--compile-target`) run eagerly here: the counter sees every operator, nothing compiles."""
    with torch.compiler.set_stance("force_eager"), FlopCounterMode(display=False) as counter:
        target.features(batch, layer_ids, keep_final=True)  # eager, never a graph's replay
    return counter.get_total_flops()
