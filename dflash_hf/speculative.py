"""Draft/verify speculative decoding against the (audio) target (README, "Use the exported draft").

One cycle: the draft proposes `B-1` tokens for the block `[x_a, M, ..., M]` at positions
`a..a+B-1` from the target features of every position `< a` (kept as a draft KV cache), the target
verifies the block in one forward, the longest agreeing prefix plus the target's bonus token is
appended, and the features of the verified positions join the draft context.
Greedy decoding is exactly the target's greedy decoding; at `temperature > 0` rejection sampling keeps
the target's distribution (Leviathan et al.).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .target import FrozenTarget


@dataclass
class SpeculativeOutput:
    sequences: torch.LongTensor  # [1, prompt + new]
    acceptance_lengths: list[int] = field(default_factory=list)  # accepted draft tokens + 1 per cycle
    num_target_forwards: int = 0

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions (a negative argument means "remove" in every transformers 5.x)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _eos_ids(target: FrozenTarget) -> set[int]:
    return target.special_ids().get("eos_token_id", set())


def _pick(logits: torch.Tensor, temperature: float, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens and (for sampling) their distributions from `[n, V]` logits."""
    if temperature <= 0:
        return logits.argmax(-1), None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs


def propose_block(draft, hidden: torch.Tensor, lm_head: torch.nn.Module, anchor_token: int, temperature, generator):
    """Draft tokens for slots 1..B-1 from the draft hidden `[B, H]` (variants may override with
    `draft.propose_block`, e.g. DFlash2's selector walk)."""
    custom = getattr(draft, "propose_block", None)
    if custom is not None:
        return custom(hidden, lm_head, anchor_token, temperature, generator)
    return _pick(lm_head(hidden[1:]), temperature, generator)


def accept_tokens(draft_tokens, q_probs, target_logits, temperature, generator) -> tuple[int, int]:
    """Number of accepted draft tokens and the next (bonus or corrected) token.

    `target_logits[i]` is the target's prediction after block position i (`[B, V]`)."""
    n = draft_tokens.shape[0]
    if temperature <= 0:
        t = target_logits.argmax(-1)
        agree = (draft_tokens == t[:n]).long()
        k = int(agree.cumprod(0).sum())
        return k, int(t[k])
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    for i in range(n):
        d = draft_tokens[i]
        ratio = p[i, d] / q_probs[i, d].clamp(min=1e-20)
        if torch.rand((), generator=generator, device=p.device) < ratio.clamp(max=1.0):
            continue
        residual = (p[i] - q_probs[i]).clamp(min=0)
        residual = residual / residual.sum() if residual.sum() > 0 else p[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return n, int(torch.multinomial(p[n], 1, generator=generator))


@torch.no_grad()
def speculative_generate(
    draft,
    target,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    **target_inputs,
) -> SpeculativeOutput:
    """Decode one prompt with draft proposals verified by the target.

    `target` is the HF model (text or audio); `target_inputs` exactly what its processor returns for
    one prompt (`input_ids`, `attention_mask`, `input_features`, ...)."""
    ft = target if isinstance(target, FrozenTarget) else FrozenTarget(target)
    input_ids = target_inputs["input_ids"]
    if input_ids.shape[0] != 1:
        raise ValueError(f"speculative_generate decodes one prompt at a time; got batch {input_ids.shape[0]}")
    cfg = draft.config
    bsz, mask_id, layer_ids = cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids
    dev = input_ids.device
    eos = _eos_ids(ft)
    draft_dtype = next(draft.parameters()).dtype

    tcache, dcache = DynamicCache(), DynamicCache()
    store: dict = {}
    with ft._hooks(layer_ids, store, keep_final=False):
        out = ft.model(**ft.cast_features(target_inputs), past_key_values=tcache, use_cache=True)
    forwards = 1
    pending = torch.cat([store[i] for i in layer_ids], dim=-1)  # features of positions not yet in dcache
    pending_pos = torch.arange(pending.shape[1], device=dev)
    # Decoder positions minus token positions: > 0 when the model expands audio placeholders itself.
    expansion = pending.shape[1] - input_ids.shape[1]
    nxt, q = _pick(out.logits[:, -1], temperature, generator)
    seq = torch.cat([input_ids, nxt.view(1, 1)], dim=1)
    accepted: list[int] = []
    while seq.shape[1] - input_ids.shape[1] < max_new_tokens and int(seq[0, -1]) not in eos:
        a = seq.shape[1] - 1 + expansion  # anchor's decoder position: last verified token, not yet run
        anchor = int(seq[0, -1])
        block_ids = torch.full((1, bsz), mask_id, device=dev, dtype=torch.long)
        block_ids[0, 0] = anchor
        pos = torch.cat([pending_pos, torch.arange(a, a + bsz, device=dev)])[None]
        hidden = draft(
            position_ids=pos,
            noise_embedding=ft.embed_tokens(block_ids).to(draft_dtype),
            target_hidden=pending.to(draft_dtype),
            past_key_values=dcache,
            use_cache=True,
        )[0]
        crop_cache(dcache, a)  # keep the context, drop the block
        proposal, q = propose_block(draft, hidden.to(ft.dtype), ft.lm_head, anchor, temperature, generator)
        verify_ids = torch.cat([block_ids[:, :1], proposal.view(1, -1)], dim=1)
        store.clear()
        with ft._hooks(layer_ids, store, keep_final=False):
            logits = ft.model(input_ids=verify_ids, past_key_values=tcache, use_cache=True).logits[0]
        forwards += 1
        k, bonus = accept_tokens(proposal, q, logits, temperature, generator)
        accepted.append(k + 1)
        crop_cache(tcache, a + k + 1)
        feats = torch.cat([store[i] for i in layer_ids], dim=-1)[:, : k + 1]
        pending, pending_pos = feats, torch.arange(a, a + k + 1, device=dev)
        new = torch.cat([proposal[:k], torch.tensor([bonus], device=dev)])
        seq = torch.cat([seq, new.view(1, -1)], dim=1)
    # Trim to max_new_tokens and stop after the first end-of-sequence token.
    gen = seq[0, input_ids.shape[1] :][:max_new_tokens]
    for i, t in enumerate(gen.tolist()):
        if t in eos:
            gen = gen[: i + 1]
            break
    return SpeculativeOutput(
        sequences=torch.cat([input_ids[0], gen])[None], acceptance_lengths=accepted, num_target_forwards=forwards
    )
