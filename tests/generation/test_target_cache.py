"""The target's KV cache in a speculative decode: `generate`'s own cache never reaches the decode's forwards, under
either keyword transformers hands it (`past_key_values` up to 5.23, `cache` from 5.24), and a forward that did not
fill the decode's cache stops the decode with a clear error instead of decoding without the prompt."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache
from utils import tiny_text_target, tiny_whisper, whisper_draft, whisper_features

from dflash_hf import DFlashConfig, DFlashDraftModel, speculative_generate
from dflash_hf.generation.speculative import dflash_custom_generate
from dflash_hf.generation.target_cache import (
    UnfilledCacheError,
    cache_keyword,
    check_prompt_cached,
    generate_state_free,
)
from dflash_hf.targets.frozen import FrozenTarget

pytestmark = pytest.mark.compat  # run on every transformers version CI tests


@pytest.fixture(scope="module")
def text():
    model, tok = tiny_text_target(num_layers=4, hidden_size=64, seed=3)
    ft = FrozenTarget(model)
    cfg = DFlashConfig.from_target_config(ft.text_config, mask_token_id=3, num_hidden_layers=1, block_size=4)
    cfg.vocab_size = ft.vocab_size
    torch.manual_seed(0)
    return model, DFlashDraftModel(cfg).eval()


def _prompt(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 250, (1, 9), generator=torch.Generator().manual_seed(seed))


def test_generate_state_is_dropped_by_name_and_by_type():
    kept = {"attention_mask": torch.ones(1, 3), "encoder_outputs": (torch.zeros(1),), "input_features": 0}
    state = {
        "past_key_values": DynamicCache(),
        "cache": DynamicCache(),
        "mems": None,
        "a_future_cache_name": DynamicCache(),
        "use_cache": True,
        "logits_to_keep": 1,
        "cache_position": torch.arange(3),
    }
    assert generate_state_free({**kept, **state}) == kept


def test_a_cache_handed_over_as_cache_stays_out_of_the_decode(text):
    """transformers 5.24 hands generate's cache over as `cache`: the decode must keep its own (greedy: generate's
    tokens), whichever keyword this version's generate used."""
    model, draft = text
    decode = dflash_custom_generate(draft)

    def under_both_names(model, input_ids, **kwargs):
        handed = kwargs.pop("past_key_values", None) or kwargs.pop("cache", None)
        assert handed is not None and handed.get_seq_length() == 0
        return decode(model, input_ids, cache=handed, past_key_values=DynamicCache(), **kwargs)

    for seed in range(2):
        prompt = _prompt(seed)
        ref = model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False)
        out = model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False, custom_generate=under_both_names)
        assert torch.equal(out, ref), seed


def test_the_decode_passes_its_cache_under_the_keyword_the_forward_names(text):
    model, _ = text
    params = FrozenTarget(model)._forward_params
    assert cache_keyword(model) == ("cache" if "cache" in params else "past_key_values")

    def forward(input_ids=None, cache=None, **kwargs):
        pass

    def legacy_forward(input_ids=None, past_key_values=None, **kwargs):
        pass

    assert cache_keyword(type("M", (), {"forward": staticmethod(forward)})) == "cache"
    assert cache_keyword(type("M", (), {"forward": staticmethod(legacy_forward)})) == "past_key_values"


def _forgetful(monkeypatch, model, fill_calls: int):
    """Make `model.forward` write its first `fill_calls` forwards into the cache it is given and later ones into a
    throwaway cache (as a forward that takes the cache under another keyword would)."""
    key, original, calls = cache_keyword(model), model.forward, []

    @functools.wraps(original)
    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) > fill_calls and kwargs.get(key) is not None:
            kwargs[key] = DynamicCache() if type(kwargs[key]) is DynamicCache else kwargs[key]
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)


@pytest.mark.parametrize("fill_calls", [0, 1])  # the prompt's forward, or a verify, misses the cache
@pytest.mark.parametrize("verify_cuda_graph", [False, True])
def test_an_unfilled_cache_stops_the_text_decode(text, monkeypatch, fill_calls, verify_cuda_graph):
    model, draft = text
    _forgetful(monkeypatch, model, fill_calls)
    if fill_calls and verify_cuda_graph:  # the fixed-shape verify writes its own buffers: nothing to miss
        out = speculative_generate(draft, model, 8, input_ids=_prompt(), verify_cuda_graph=True)
        assert out.verify_step == "fixed-shape, no graph"
        return
    message = "did not fill the cache" if fill_calls == 0 else "did not append the block"
    with pytest.raises(UnfilledCacheError, match=message):
        speculative_generate(draft, model, 8, input_ids=_prompt(), verify_cuda_graph=verify_cuda_graph)


def test_an_unfilled_cache_stops_the_whisper_decode(monkeypatch):
    model, processor = tiny_whisper()
    key, original = cache_keyword(model), model.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        cache = kwargs.get(key)
        if cache is not None:
            kwargs[key] = type(cache)(DynamicCache(), DynamicCache())  # a fresh EncoderDecoderCache
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    with pytest.raises(UnfilledCacheError, match="holds 0 positions"):
        speculative_generate(whisper_draft(model), model, 8, input_features=whisper_features(processor, 0))


def test_an_empty_cross_attention_cache_is_refused():
    from transformers import EncoderDecoderCache

    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    cache.self_attention_cache.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), 0)
    with pytest.raises(UnfilledCacheError, match="cross-attention cache .* is empty"):
        check_prompt_cached(cache, 3, 3, torch.nn.Linear(1, 1))
    check_prompt_cached(cache.self_attention_cache, 3, 3, torch.nn.Linear(1, 1))  # decoder-only: fine
