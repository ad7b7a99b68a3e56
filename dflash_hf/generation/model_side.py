"""Greedy decoding of a model-side single-placeholder target (legacy Qwen2-Audio / SALM layout) without `generate`:
the baseline its speculative decoding (`dflash_hf.generation.speculative`) must equal."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from dflash_hf.generation.prompt_padding import check_one_prompt, refuse_padding
from dflash_hf.generation.target_cache import cache_keyword
from dflash_hf.generation.verify_rules import eos_token_ids
from dflash_hf.targets.frozen import FrozenTarget, TargetModel


@torch.no_grad()
def model_side_greedy(target: TargetModel, max_new_tokens: int, **target_inputs) -> torch.LongTensor:
    """Plain greedy decoding of a model-side single-placeholder target (legacy Qwen2-Audio / SALM layout), the
    baseline its speculative decoding must equal: transformers' `generate` drops the 2D mask the audio merge needs
    (an error, or another sequence, depending on the version), so this is the target's own forward with a KV cache,
    one token a step, ending at an end token of its configs or after `max_new_tokens`. Token-equal to one full
    forward per token (tested). Returns prompt ids + new tokens `[1, L + n]`."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ft = FrozenTarget.of(target)
    input_ids = target_inputs["input_ids"]
    check_one_prompt(input_ids)
    refuse_padding(target_inputs.get("attention_mask"), model_side_what(ft))
    eos = eos_token_ids(ft)
    cache = DynamicCache()
    key = cache_keyword(ft.model)  # `past_key_values`, or `cache` from transformers 5.24
    prefill = {**ft.cast_features(target_inputs), key: cache, "use_cache": True}
    if ft.keeps_last_logits_only:
        prefill["logits_to_keep"] = 1
    logits = ft.model(**prefill).logits
    new: list[int] = []
    while True:
        token = logits[0, -1].argmax(-1)
        new.append(int(token))
        if new[-1] in eos or len(new) >= max_new_tokens:
            break
        logits = ft.model(input_ids=token.view(1, 1), **{key: cache}, use_cache=True).logits
    return torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)


def model_side_what(ft: FrozenTarget) -> str:
    return f"decoding a {ft.family.name} target (its model expands the audio placeholder itself)"
