"""The target's KV cache during a speculative decode: the keyword its forward takes it under, the copies of
`generate`'s own state that a `custom_generate` callable receives (and must not pass on), and the checks that the
cache holds what the decode assumes.

transformers renamed the forward's cache keyword from `past_key_values` to `cache` in 5.24 (the old name still
works there, with a deprecation warning, and loses to `cache` when both are given), and `generate` hands its own,
still empty, cache to a `custom_generate` callable under whichever name it uses. A decode that passed that keyword
on would fill `generate`'s cache with the prompt and leave its own empty: every later forward would run without
the prompt. :func:`generate_state_free` drops it by name and by type, and :func:`check_prompt_cached` refuses to
decode when the prompt's forward did not fill the decode's cache.
"""

from __future__ import annotations

import inspect

from transformers import Cache, EncoderDecoderCache

# Names under which transformers' `generate` keeps its cache (`past_key_values` up to 5.23, `cache` from 5.24, and
# the legacy names of a few architectures), and the other keywords of its standard step the decode sets itself.
GENERATE_CACHE_KEYS = frozenset({"past_key_values", "cache", "cache_params", "state", "mems", "past_buckets_states"})
GENERATE_LOOP_KEYS = GENERATE_CACHE_KEYS | {
    "use_cache",
    "logits_to_keep",
    "cache_position",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
}


def cache_keyword(model) -> str:
    """The keyword `model.forward` takes its KV cache under: `cache` (transformers >= 5.24) where the forward
    names it, else `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def generate_state_free(model_kwargs: dict) -> dict:
    """`model_kwargs` as `generate` hands them to a `custom_generate` callable, without its loop state: the keys
    of :data:`GENERATE_LOOP_KEYS` and any other value that is a cache."""
    return {k: v for k, v in model_kwargs.items() if k not in GENERATE_LOOP_KEYS and not isinstance(v, Cache)}


def self_attention_length(cache) -> int:
    """Positions held by the (decoder's self-attention) cache."""
    cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    return cache.get_seq_length()


class UnfilledCacheError(RuntimeError):
    """The target's forward did not write into the cache the decode gave it: decoding on would run without the
    prompt (or without the tokens verified so far)."""


def check_prompt_cached(cache, positions: int, tokens: int, model) -> None:
    """After the prompt's forward: the decode's cache holds exactly the prompt's `positions` decoder positions
    (`tokens` ids, more positions where the model expands audio placeholders itself) and, for an encoder-decoder
    target, the cross-attention keys of the encoder output. Raises :class:`UnfilledCacheError` otherwise."""
    held = self_attention_length(cache)
    if positions < tokens or held != positions:
        raise UnfilledCacheError(
            f"after the prompt's forward the target's KV cache holds {held} positions, but the prompt has {tokens} "
            f"tokens ({positions} decoder positions): {type(model).__name__}.forward did not fill the cache the "
            f"speculative decode passed as `{cache_keyword(model)}`, so decoding would continue without the prompt. "
            "This transformers version hands the cache differently; use a version the package declares "
            "(pyproject.toml) or report it."
        )
    if isinstance(cache, EncoderDecoderCache) and cache.cross_attention_cache.get_seq_length() == 0:
        raise UnfilledCacheError(
            f"after the prompt's forward the cross-attention cache of {type(model).__name__} is empty: the encoder "
            "output was not cached, so decoding would continue without the audio"
        )


def check_block_cached(cache, expected: int, model) -> None:
    """After a verify over the growing cache: it holds the `expected` positions (context plus the block)."""
    held = self_attention_length(cache)
    if held != expected:
        raise UnfilledCacheError(
            f"after a verify forward the target's KV cache holds {held} positions, expected {expected}: "
            f"{type(model).__name__}.forward did not append the block to the cache the decode passed as "
            f"`{cache_keyword(model)}`"
        )
