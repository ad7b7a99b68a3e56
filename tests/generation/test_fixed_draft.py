"""The fixed-shape draft step (`dflash_hf.generation.fixed_draft`, replayed as a CUDA graph on a GPU): on the CPU it
runs
without a graph (`draft_cuda_graph=True`) and must propose what the eager loop proposes, cycle by cycle, for text and
Whisper targets, DFlash and DFlash2, with and without the encoder-context opt-in, and a prompt longer than a block.
The GPU tier (tests/gpu) checks the captured graph against the same step."""

from __future__ import annotations

import copy
import gc
import weakref

import numpy as np
import pytest
import torch
from utils import TINY_WHISPER_MASK as MASK
from utils import decode_with_proposals, make_args, raising, tiny_text_target, tiny_whisper

from dflash_hf import DFlash2DraftModel, DFlashConfig, DFlashDraftModel, speculative_generate
from dflash_hf.generation import fixed_draft
from dflash_hf.generation.fixed_draft import FixedDraftCache, clear_fixed_draft_steps, fixed_capacity, fixed_draft_steps
from dflash_hf.targets.builder import build_target_and_draft
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny


def _same_decode(draft, target, max_new_tokens, fresh=True, **inputs):
    eager, eager_props = decode_with_proposals(draft, target, max_new_tokens, False, **inputs)
    if fresh:
        clear_fixed_draft_steps(draft)
    static, static_props = decode_with_proposals(draft, target, max_new_tokens, True, **inputs)
    assert fixed_draft_steps(draft)  # the fixed-shape step ran, and says so
    assert (static.draft_step, eager.draft_step) == ("fixed-shape, no graph", "eager")
    assert torch.equal(static.sequences, eager.sequences)
    assert static.acceptance_lengths == eager.acceptance_lengths
    assert len(static_props) == len(eager_props) > 2
    for a, b in zip(static_props, eager_props):
        assert torch.equal(a, b)
    return eager


def _text_draft(ft, cls, block):
    cfg = DFlashConfig.from_target_config(
        ft.text_config,
        mask_token_id=3,
        num_hidden_layers=2,
        block_size=block,
        **({"variant": "dflash2"} if cls is DFlash2DraftModel else {}),
    )
    cfg.vocab_size = ft.vocab_size
    torch.manual_seed(1)
    draft = cls(cfg).eval()
    if cls is DFlash2DraftModel:  # a selector that matters: non-zero successor codebook, dynamic convolutions
        with torch.no_grad():
            draft.candidate_selector.successor_codebook.normal_(0, 0.5)
            for layer in draft.layers:
                layer.attention_conv.kernel_projection.weight.normal_(0, 0.05)
    return draft


@pytest.mark.compat
@pytest.mark.parametrize("cls", [DFlashDraftModel, DFlash2DraftModel])
@pytest.mark.parametrize("prompt_len", [5, 19])  # within one block, and over two blocks of context
@pytest.mark.slow  # 22 s on 2 busy cores
def test_text_target_static_step_proposes_what_the_eager_loop_proposes(cls, prompt_len):
    model, tok = tiny_text_target(seed=3)
    ft = FrozenTarget(tiny.sharpen(model, seed=3))
    draft = _text_draft(ft, cls, block=8)
    ids = torch.randint(4, ft.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    _same_decode(draft, ft, 40, input_ids=ids, attention_mask=torch.ones_like(ids))


@pytest.fixture(scope="module")
def whisper():
    return tiny_whisper()


@pytest.mark.slow  # 13 s on 2 busy cores
def test_whisper_encoder_context_static_step_across_utterances(whisper, tmp_path):
    model, processor = whisper
    args = make_args(
        tmp_path, mask_token_id=MASK, num_draft_layers=2, draft_encoder_context=True, block_size=4, variant="dflash2"
    )
    torch.manual_seed(0)
    draft = build_target_and_draft(FrozenTarget(model), args).draft.eval()
    for seed in range(2):  # the second utterance reuses the first one's step: its frames' keys/values are refilled
        audio = np.random.default_rng(seed).standard_normal(16000).astype(np.float32) * 0.1
        feats = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt")["input_features"]
        _same_decode(draft, model, 24, fresh=seed == 0, input_features=feats)
        steps = fixed_draft_steps(draft)
        if seed == 0:
            first = next(iter(steps.values()))
    assert list(steps.values()) == [first]  # one step (one capture on a GPU) serves both utterances
    copy.deepcopy(draft)  # the steps live beside the draft, not on it
    assert set(draft.state_dict()) == set(build_target_and_draft(FrozenTarget(model), args).draft.state_dict())


@pytest.mark.slow  # 214 s on 2 busy cores
def test_dflash2_decodes_up_to_whispers_last_position(whisper, tmp_path):
    """Near Whisper's 448 positions the last blocks are cut to what is left: the draft still runs whole blocks
    (DFlash2's convolutions take nothing else), eager and fixed-shape alike, and the output is Whisper's own."""
    model, processor = copy.deepcopy(whisper[0]), whisper[1]
    model.generation_config.suppress_tokens = [*model.generation_config.suppress_tokens, 256]  # no <|endoftext|>
    args = make_args(tmp_path, mask_token_id=MASK, num_draft_layers=1, block_size=8, variant="dflash2")
    torch.manual_seed(0)
    draft = build_target_and_draft(FrozenTarget(model), args).draft.eval()
    audio = np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.1
    feats = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt")["input_features"]
    greedy = model.generate(feats, max_new_tokens=444, do_sample=False)
    eager = _same_decode(draft, model, 444, input_features=feats)
    assert eager.sequences.shape[1] == model.config.max_target_positions == 448
    assert torch.equal(eager.sequences[:, 4:], greedy)  # Whisper's generate leaves out its 4-token decoder prompt


def test_static_cache_writes_the_context_rows_and_returns_buffer_then_block():
    cache = FixedDraftCache(
        1, kv_heads=2, head_dim=3, capacity=10, ctx_rows=4, dtype=torch.float32, device=torch.device("cpu")
    )
    cache.write_index = torch.arange(4) + 5
    k = torch.randn(1, 2, 7, 3)  # 4 context rows, 3 block rows
    keys, values = cache.update(k, k + 1, 0)
    assert keys.shape == (1, 2, 13, 3)
    assert torch.equal(keys[:, :, 5:9], k[:, :, :4]) and torch.equal(keys[:, :, 10:], k[:, :, 4:])
    assert not keys[:, :, :5].any() and not keys[:, :, 9:10].any()
    assert torch.equal(values[:, :, 5:9], k[:, :, :4] + 1)


def test_capacity_covers_the_last_block_and_bounds_the_buffer():
    assert fixed_capacity(448, 8) == 512  # Whisper's 448 positions + two blocks, rounded to 128
    assert fixed_capacity(100, 16) == 256 and fixed_capacity(96, 16) == 128
    assert fixed_capacity(16384, 8) is None


@pytest.mark.slow  # 119 s on 2 busy cores
def test_steps_per_draft_are_bounded_least_recently_used_first(monkeypatch):

    monkeypatch.setattr(fixed_draft, "MAX_STEPS_PER_DRAFT", 2)
    model, tok = tiny_text_target(seed=3)
    ft = FrozenTarget(model)
    draft = _text_draft(ft, DFlashDraftModel, block=4)
    ids = torch.randint(4, ft.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    for new_tokens in (8, 200, 8, 400):  # capacities 128, 256, 128 (reused), 512
        speculative_generate(draft, ft, new_tokens, draft_cuda_graph=True, input_ids=ids)
    assert [key[3] for key in fixed_draft_steps(draft)] == [128, 512]  # 256 was the least recently used


@pytest.mark.slow  # 8 s on 2 busy cores
def test_a_step_keeps_neither_draft_nor_target_alive_and_follows_moved_weights():
    model, tok = tiny_text_target(seed=3)
    ft = FrozenTarget(model)
    draft = _text_draft(ft, DFlash2DraftModel, block=4)
    ids = torch.randint(4, ft.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # a step made under inference mode serves decodes outside it too
        first = speculative_generate(draft, ft, 12, draft_cuda_graph=True, input_ids=ids)
    (step,) = fixed_draft_steps(draft).values()
    again = speculative_generate(draft, ft, 12, draft_cuda_graph=True, input_ids=ids)
    assert list(fixed_draft_steps(draft).values()) == [step] and torch.equal(again.sequences, first.sequences)
    draft.to(torch.float64).to(torch.float32)  # the same dtype, new parameter storage: a new step
    speculative_generate(draft, ft, 12, draft_cuda_graph=True, input_ids=ids)
    (moved,) = fixed_draft_steps(draft).values()
    assert moved is not step
    refs = weakref.ref(draft), weakref.ref(model)
    del draft, model, ft, step, moved
    gc.collect()
    assert refs[0]() is None and refs[1]() is None


def test_sampling_and_auto_on_the_cpu_keep_the_eager_draft():
    model, tok = tiny_text_target(seed=3)
    ft = FrozenTarget(model)
    draft = _text_draft(ft, DFlashDraftModel, block=4)
    ids = torch.randint(4, ft.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    speculative_generate(draft, ft, 8, temperature=1.0, generator=torch.Generator().manual_seed(0), input_ids=ids)
    assert not fixed_draft_steps(draft)  # sampling: the eager draft forward
    with pytest.raises(ValueError, match=r"draft_cuda_graph=True: .* not sampling \(temperature > 0\)"):
        speculative_generate(draft, ft, 8, temperature=1.0, draft_cuda_graph=True, input_ids=ids)
    with pytest.raises(ValueError, match="more than the fixed step's 16384"):
        speculative_generate(draft, ft, 16384, draft_cuda_graph=True, input_ids=ids)
    speculative_generate(draft, ft, 8, input_ids=ids)  # auto on the CPU: eager
    assert not fixed_draft_steps(draft)


def test_a_failing_draft_step_falls_back_under_the_default_and_raises_when_asked_for(monkeypatch, caplog):

    calls = []
    monkeypatch.setattr(fixed_draft, "draft_step_for", raising(calls, RuntimeError("capture failed")))
    model, _ = tiny_text_target(seed=3)
    ft = FrozenTarget(model)
    draft = _text_draft(ft, DFlashDraftModel, block=4)
    cuda = type(
        "OnCuda",
        (),
        {"device": torch.device("cuda"), "embed_tokens": torch.nn.Identity(), "lm_head": torch.nn.Identity()},
    )()  # a target on a GPU, its weights nowhere else
    monkeypatch.setattr(draft, "parameters", lambda: iter(()))
    kw = dict(device=torch.device("cuda"), sample=False, max_positions=None, max_length=64, expansion=0)
    with caplog.at_level("WARNING", logger="dflash_hf.ops.cuda_graphs"):
        assert fixed_draft.fixed_draft_step(None, draft, cuda, 4, None, **kw) is None
    assert "RuntimeError: capture failed" in caplog.text and "eager draft forward" in caplog.text
    assert fixed_draft.fixed_draft_step(None, draft, cuda, 4, None, **kw) is None and len(calls) == 1
    with pytest.raises(RuntimeError, match="capture failed"):
        fixed_draft.fixed_draft_step(True, draft, cuda, 4, None, **kw)
    clear_fixed_draft_steps(draft)  # forgets the failure
    assert fixed_draft.fixed_draft_step(None, draft, cuda, 4, None, **kw) is None and len(calls) == 3
    monkeypatch.setattr(fixed_draft, "draft_step_for", raising(calls, torch.OutOfMemoryError("no room")))
    clear_fixed_draft_steps(draft)
    for _ in range(2):  # out of memory: not remembered
        assert fixed_draft.fixed_draft_step(None, draft, cuda, 4, None, **kw) is None
    assert len(calls) == 5
