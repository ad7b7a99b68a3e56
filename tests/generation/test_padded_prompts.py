"""A padded prompt (what `tokenizer([...], padding="max_length")` or a padding processor returns, left or right)
decodes as the target's own `generate` decodes the same padded inputs: every verify forward (growing cache and
fixed-shape) attends through the prompt's mask at `generate`'s positions, and the draft never sees the padding."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from utils import decode_with_proposals, scripted_draft

from dflash_hf import DFlashConfig, DFlashDraftModel, speculative_generate
from dflash_hf.generation.model_side import model_side_greedy
from dflash_hf.generation.prompt_padding import generate_positions, prompt_padding
from dflash_hf.generation.speculative import dflash_custom_generate
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny

pytestmark = pytest.mark.compat  # run on every transformers version CI tests

TEXT = "the quick brown fox jumps"
WIDTH = 40  # padded prompt length
NEW = 24


@pytest.fixture(scope="module")
def text():
    tok = tiny.build_tokenizer()
    model = tiny.sharpen(tiny.build_text_target(tok, num_layers=4, hidden_size=64, seed=3), seed=3)
    ft = FrozenTarget(model)
    cfg = DFlashConfig.from_target_config(ft.text_config, mask_token_id=3, num_hidden_layers=1, block_size=4)
    cfg.vocab_size = ft.vocab_size
    torch.manual_seed(0)
    return model, tok, DFlashDraftModel(cfg).eval()


def _padded(tok, side: str) -> dict:
    tok.padding_side = side
    try:
        return dict(tok([TEXT], padding="max_length", max_length=WIDTH, return_tensors="pt"))
    finally:
        tok.padding_side = "right"


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_text_prompt_decodes_as_generate(text, side):
    model, tok, draft = text
    inputs = _padded(tok, side)
    assert 0 < int(inputs["attention_mask"].sum()) < WIDTH
    ref = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    assert len(set(ref[0, WIDTH:].tolist())) > 2  # a varied continuation: positions and mask matter
    for verify in (False, True):
        for right in (None, 1):  # whole blocks accepted, or two tokens a cycle
            out = speculative_generate(
                scripted_draft(draft, ref, WIDTH, right), model, NEW, verify_cuda_graph=verify, **inputs
            )
            assert torch.equal(out.sequences, ref), (verify, right)
            assert max(out.acceptance_lengths) == (4 if right is None else 2)
        del draft.propose_block  # the draft's own proposals, through its fixed-shape step too
        for draft_graph in (False, True):
            out = speculative_generate(
                draft, model, NEW, verify_cuda_graph=verify, draft_cuda_graph=draft_graph, **inputs
            )
            assert torch.equal(out.sequences, ref), (verify, draft_graph)
        custom = dflash_custom_generate(draft, verify_cuda_graph=verify)
        assert torch.equal(model.generate(**inputs, max_new_tokens=NEW, do_sample=False, custom_generate=custom), ref)


def test_the_draft_never_sees_the_padding(text):
    """Left padding: the draft proposes what it proposes for the unpadded prompt, cycle by cycle."""
    model, tok, draft = text
    plain = dict(tok([TEXT], return_tensors="pt"))
    padded = _padded(tok, "left")
    for draft_graph in (False, True):
        out_plain, seen_plain = decode_with_proposals(draft, model, NEW, draft_graph, **plain)
        out_padded, seen_padded = decode_with_proposals(draft, model, NEW, draft_graph, **padded)
        n = plain["input_ids"].shape[1]
        assert torch.equal(out_padded.sequences[:, WIDTH - n :], out_plain.sequences)
        assert len(seen_padded) == len(seen_plain) > 2
        assert all(torch.equal(a, b) for a, b in zip(seen_padded, seen_plain)), draft_graph


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_speech_prompt_decodes_as_generate(side):
    asr, processor = tiny.build_qwen3_asr_target(
        tiny.build_tokenizer(), hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1
    )
    tiny.sharpen(asr)
    conv = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Transcribe."}]}]
    rendered = processor.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    audio = [np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.1]
    n = processor(text=[rendered], audio=audio, sampling_rate=16000, return_tensors="pt")["input_ids"].shape[1]
    processor.tokenizer.padding_side = side
    inputs = dict(
        processor(
            text=[rendered],
            audio=audio,
            sampling_rate=16000,
            return_tensors="pt",
            padding="max_length",
            max_length=n + 7,
        )
    )
    assert int((inputs["attention_mask"] == 0).sum()) == 7
    ft = FrozenTarget(asr)
    cfg = DFlashConfig.from_target_config(ft.text_config, mask_token_id=3, num_hidden_layers=1, block_size=4)
    cfg.vocab_size = ft.vocab_size
    torch.manual_seed(0)
    draft = DFlashDraftModel(cfg).eval()
    ref = asr.generate(**inputs, max_new_tokens=16, do_sample=False)
    for right in (None, 1):
        for verify in (False, True):
            out = speculative_generate(
                scripted_draft(draft, ref, n + 7, right), asr, 16, verify_cuda_graph=verify, **inputs
            )
            assert torch.equal(out.sequences, ref), (right, verify)


def test_padded_sampling_follows_the_unpadded_prompt(text):
    """At T > 0 a left-padded prompt samples as the unpadded one (the same scores, the same random stream)."""
    model, tok, draft = text
    plain, padded = dict(tok([TEXT], return_tensors="pt")), _padded(tok, "left")
    n = plain["input_ids"].shape[1]
    for seed in range(3):
        a = speculative_generate(draft, model, NEW, 1.0, torch.Generator().manual_seed(seed), **plain)
        b = speculative_generate(draft, model, NEW, 1.0, torch.Generator().manual_seed(seed), **padded)
        assert torch.equal(b.sequences[:, WIDTH - n :], a.sequences), seed


def test_generate_positions_and_the_padding_record():
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    assert generate_positions(mask).tolist() == [[0, 0, 0, 1, 2]]
    padding = prompt_padding(mask, None, 5)
    assert padding.skipped == 2 and padding.offset == -2 and padding.keep.tolist() == [False, False, True, True, True]
    step = padding.verify_kwargs(5, 9)  # a block of 4 after the prompt
    assert step["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 1]]
    assert step["position_ids"].tolist() == [[3, 4, 5, 6]]
    right = prompt_padding(torch.tensor([[1, 1, 0]]), torch.tensor([[0, 1, 0]]), 3)  # generate: after the last id
    assert right.offset == -2 and right.verify_kwargs(3, 5)["position_ids"].tolist() == [[1, 2]]
    assert prompt_padding(None, None, 4) is None
    assert prompt_padding(torch.ones(1, 4, dtype=torch.long), torch.arange(4)[None], 4) is None
    assert prompt_padding(torch.ones(1, 4, dtype=torch.long), torch.zeros(3, 1, 4), 4) is None  # multimodal rope
    with pytest.raises(ValueError, match="all zeros"):
        prompt_padding(torch.zeros(1, 3, dtype=torch.long), None, 3)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        prompt_padding(torch.ones(1, 2, dtype=torch.long), None, 3)
    with pytest.raises(ValueError, match="position_ids of shape"):
        prompt_padding(torch.tensor([[0, 1, 1]]), torch.zeros(3, 1, 3), 3)


def test_padding_is_refused_where_the_model_expands_the_prompt(text, monkeypatch):
    model, tok, draft = text
    ft = FrozenTarget(model)
    monkeypatch.setattr(ft, "family", SimpleNamespace(name="qwen2_audio_single_placeholder", expansion="model"))
    inputs = _padded(tok, "left")
    with pytest.raises(ValueError, match="takes an unpadded prompt, but its attention_mask masks"):
        speculative_generate(draft, ft, 8, **inputs)
    with pytest.raises(ValueError, match="takes an unpadded prompt"):
        model_side_greedy(ft, 8, **inputs)
