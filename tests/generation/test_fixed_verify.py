"""The target's verify as a fixed-shape forward (`verify_cuda_graph=True`; on the CPU without a graph): the same decode
as the growing cache, whole blocks, partly accepted blocks and rejected ones alike, across utterances."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from utils import raising, scripted_draft, tiny_qwen3_asr_prompt, tiny_whisper, whisper_draft, whisper_features

from dflash_hf import DFlashConfig, DFlashDraftModel, speculative_generate
from dflash_hf.generation import fixed_verify
from dflash_hf.generation.fixed_draft import MAX_FIXED_POSITIONS
from dflash_hf.generation.speculative import dflash_custom_generate
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny

pytestmark = pytest.mark.compat  # run on every transformers version CI tests

BLOCK = 4


@pytest.fixture(scope="module")
def whisper():
    return tiny_whisper()


@pytest.mark.slow  # 22 s on 2 busy cores
def test_fixed_shape_verify_decodes_as_the_growing_cache(whisper):
    model, processor = whisper
    fixed_verify.clear_fixed_verify_steps(model)
    for seed in range(3):  # one step serves every utterance: its prompt rows and cross keys are refilled
        feats = whisper_features(processor, seed)
        ref = model.generate(feats, max_new_tokens=24, return_dict_in_generate=True).sequences
        for right in (0, 1, BLOCK - 1):
            eager = speculative_generate(
                scripted_draft(whisper_draft(model), ref, 4, right), model, 24, input_features=feats
            )
            fixed = speculative_generate(
                scripted_draft(whisper_draft(model), ref, 4, right),
                model,
                24,
                input_features=feats,
                verify_cuda_graph=True,
            )
            assert torch.equal(fixed.sequences, ref) and torch.equal(eager.sequences, ref), (seed, right)
            assert fixed.acceptance_lengths == eager.acceptance_lengths, (seed, right)
            assert fixed.verify_step == "fixed-shape, no graph" and eager.verify_step == "eager"
            assert fixed.num_target_forwards == eager.num_target_forwards
        assert eager.acceptance_lengths[0] == BLOCK  # the last setting accepts whole blocks
    assert len(fixed_verify.fixed_verify_steps(model)) == 1
    plain = model.generate(feats, max_new_tokens=24)
    custom = dflash_custom_generate(whisper_draft(model), verify_cuda_graph=True)
    assert torch.equal(model.generate(feats, max_new_tokens=24, custom_generate=custom), plain)
    assert custom.verify_step == "fixed-shape, no graph"


def test_fixed_shape_verify_is_refused_where_it_cannot_apply(whisper):
    model, processor = whisper
    feats = whisper_features(processor, 0)
    with pytest.raises(ValueError, match=r"verify_cuda_graph=True: .* not sampling \(temperature > 0\)"):
        speculative_generate(
            whisper_draft(model), model, 8, temperature=1.0, verify_cuda_graph=True, input_features=feats
        )
    with pytest.raises(ValueError, match="may pass the decoder's 448 positions"):  # 4 + 443 - 2 + 4 > 448
        speculative_generate(whisper_draft(model), model, 443, verify_cuda_graph=True, input_features=feats)
    for model_type, attention, message in (
        ("moonshine", "sdpa", "an encoder-decoder target other than Whisper"),
        ("whisper", "flash_attention_2", "attn_implementation 'flash_attention_2'"),
    ):
        config = SimpleNamespace(model_type=model_type, _attn_implementation=attention)
        fake = SimpleNamespace(
            model=SimpleNamespace(config=config, parameters=model.parameters),
            decoder=SimpleNamespace(config=config),
            device=torch.device("cpu"),
            is_encoder_decoder=True,
        )
        with pytest.raises(ValueError, match=message):  # flash attention: its mask would not be additive
            fixed_verify.check_verify_step(
                fake, BLOCK, {"encoder_outputs": (None,)}, sample=False, max_positions=448, max_length=30
            )


def test_auto_verify_runs_on_a_gpu_where_it_can_and_falls_back_elsewhere():
    """`verify_cuda_graph=None` (dflash-eval's default `auto`): the fixed-shape verify on a GPU where it can run and
    its buffers stay within MAX_FIXED_POSITIONS rows, the growing cache otherwise, without an error; True forces it."""

    def fake(model_type, device, encoder_decoder):
        config = SimpleNamespace(model_type=model_type, _attn_implementation="sdpa")
        return SimpleNamespace(
            model=SimpleNamespace(config=config, parameters=lambda: iter(())),
            decoder=SimpleNamespace(config=config),
            device=torch.device(device),
            is_encoder_decoder=encoder_decoder,
        )

    whisper_kw = dict(sample=False, max_positions=448, max_length=30, expansion=0)
    rows = fixed_verify.fixed_verify_rows
    assert rows(None, fake("whisper", "cuda", True), BLOCK, {"encoder_outputs": (None,)}, **whisper_kw) == 448
    assert rows(None, fake("whisper", "cpu", True), BLOCK, {"encoder_outputs": (None,)}, **whisper_kw) is None
    assert rows(True, fake("whisper", "cpu", True), BLOCK, {"encoder_outputs": (None,)}, **whisper_kw) == 448
    assert rows(False, fake("whisper", "cuda", True), BLOCK, {"encoder_outputs": (None,)}, **whisper_kw) is None
    sampled = dict(whisper_kw, sample=True)
    assert rows(None, fake("whisper", "cuda", True), BLOCK, {"encoder_outputs": (None,)}, **sampled) is None
    text = fake("qwen3", "cuda", False)
    assert rows(None, text, BLOCK, {}, sample=False, max_positions=None, max_length=100, expansion=50) == 256
    assert rows(None, text, BLOCK, {}, sample=False, max_positions=None, max_length=None, expansion=0) is None
    long = dict(sample=False, max_positions=None, max_length=MAX_FIXED_POSITIONS, expansion=0)
    assert rows(None, text, BLOCK, {}, **long) is None  # too many rows for auto
    assert rows(True, text, BLOCK, {}, **long) > MAX_FIXED_POSITIONS  # asked for: it runs


def test_a_failing_fixed_verify_falls_back_under_the_default_and_raises_when_asked_for(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(fixed_verify, "verify_step_for", raising(calls, RuntimeError("capture failed")))
    model = torch.nn.Linear(2, 2)
    ft = SimpleNamespace(model=model, device=torch.device("cuda"))
    monkeypatch.setattr(fixed_verify, "fixed_verify_rows", lambda *a, **k: 448)
    kw = dict(sample=False, max_positions=448, max_length=30, expansion=0)
    cache = _small_cache()
    with caplog.at_level("WARNING", logger="dflash_hf.ops.cuda_graphs"):  # the shared fallback logs there
        assert fixed_verify.fixed_verify_step(None, ft, [1], BLOCK, cache, {}, **kw) is None
    assert "RuntimeError: capture failed" in caplog.text and "growing cache" in caplog.text
    assert fixed_verify.fixed_verify_step(None, ft, [1], BLOCK, cache, {}, **kw) is None
    assert len(calls) == 1  # not tried again for this model
    with pytest.raises(RuntimeError, match="capture failed"):
        fixed_verify.fixed_verify_step(True, ft, [1], BLOCK, cache, {}, **kw)
    fixed_verify.clear_fixed_verify_steps(model)  # forgets the failure: tried again
    assert fixed_verify.fixed_verify_step(None, ft, [1], BLOCK, cache, {}, **kw) is None and len(calls) == 3
    monkeypatch.setattr(fixed_verify, "verify_step_for", raising(calls, torch.OutOfMemoryError("no room")))
    other = SimpleNamespace(model=torch.nn.Linear(2, 2), device=torch.device("cuda"))
    for _ in range(2):  # out of memory: not remembered, tried again next decode
        assert fixed_verify.fixed_verify_step(None, other, [1], BLOCK, cache, {}, **kw) is None
    assert len(calls) == 5


def test_a_decode_after_a_failed_fixed_verify_is_the_growing_cache_decode(monkeypatch):
    _, model, inputs = next(_decoder_only_cases())
    ft = FrozenTarget(model)
    ref = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    cfg = DFlashConfig.from_target_config(ft.text_config, mask_token_id=262, num_hidden_layers=1, block_size=BLOCK)

    def draft():  # a scripted draft follows one decode
        torch.manual_seed(0)
        return scripted_draft(DFlashDraftModel(cfg).eval(), ref, inputs["input_ids"].shape[1], 1)

    ids = inputs["input_ids"]
    eager = speculative_generate(draft(), ft, 12, verify_cuda_graph=False, input_ids=ids)

    monkeypatch.setattr(fixed_verify, "fixed_verify_rows", lambda *a, **k: 128)  # as if on a GPU
    monkeypatch.setattr(fixed_verify, "verify_step_for", raising([], RuntimeError("capture failed")))
    out = speculative_generate(draft(), ft, 12, input_ids=ids)
    assert out.verify_step == "eager" and torch.equal(out.sequences, eager.sequences)
    assert out.acceptance_lengths == eager.acceptance_lengths
    fixed_verify.clear_fixed_verify_steps(model)


def test_the_kept_steps_of_a_model_stay_within_the_budget(monkeypatch):
    class FakeStep:
        def __init__(self, ft, layer_ids, block, rows, *rest):
            self.rows, self.nbytes = rows, fixed_verify.buffer_bytes(_small_cache(), rows)

        def serves(self, ft):
            return True

        def start(self, *args):
            pass

    monkeypatch.setattr(fixed_verify, "FixedVerifyStep", FakeStep)
    ft = SimpleNamespace(model=torch.nn.Linear(2, 2), device=torch.device("cpu"), dtype=torch.float32)
    per_row = fixed_verify.buffer_bytes(_small_cache(), 1)
    for rows in (128, 256, 384):
        fixed_verify.verify_step_for(ft, [1], BLOCK, rows, _small_cache(), {}, False, budget=per_row * 500)
    kept = [k[4] for k in fixed_verify.fixed_verify_steps(ft.model)]
    assert kept == [384]  # 128 + 256 + 384 rows would pass 500: the least recently used went first
    fixed_verify.verify_step_for(ft, [1], BLOCK, 128, _small_cache(), {}, False, budget=per_row * 600)
    assert [k[4] for k in fixed_verify.fixed_verify_steps(ft.model)] == [384, 128]
    fixed_verify.clear_fixed_verify_steps(ft.model)


def _small_cache(layers: int = 1):
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(layers):  # 2 kv heads, head_dim 4, float32
        cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), layer)
    return cache


def test_the_default_keeps_the_growing_cache_when_the_buffers_would_be_large(monkeypatch):
    cache = _small_cache(layers=3)
    assert fixed_verify.buffer_bytes(cache, 448) == 2 * 3 * 2 * 4 * 448 * 4
    monkeypatch.setattr(fixed_verify, "verify_step_for", lambda *a, **k: "step")
    monkeypatch.setattr(fixed_verify, "fixed_verify_rows", lambda *a, **k: 448)
    ft = SimpleNamespace(model=torch.nn.Linear(2, 2), device=torch.device("cuda"))
    kw = dict(sample=False, max_positions=448, max_length=30, expansion=0)
    assert fixed_verify.fixed_verify_step(None, ft, [1], BLOCK, cache, {}, **kw) == "step"
    monkeypatch.setattr(fixed_verify, "AUTO_MAX_BUFFER_BYTES", 2 * 3 * 2 * 4 * 448 * 4 - 1)
    assert fixed_verify.fixed_verify_step(None, ft, [1], BLOCK, cache, {}, **kw) is None
    assert fixed_verify.fixed_verify_step(True, ft, [1], BLOCK, cache, {}, **kw) == "step"  # asked for: it runs


def test_a_sliding_window_decoder_keeps_the_growing_cache():
    """The fixed verify's explicit causal mask would take a sliding window's band away: refused when asked for, and
    never chosen by the default."""
    from transformers import AutoModelForCausalLM, MistralConfig

    config = MistralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
    )
    ft = FrozenTarget(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"))
    kw = dict(sample=False, max_positions=None, max_length=30)
    assert "sliding-window" in fixed_verify.verify_step_blocker(ft, BLOCK, {}, **kw)
    with pytest.raises(ValueError, match="verify_cuda_graph=True: .* sliding-window"):
        fixed_verify.check_verify_step(ft, BLOCK, {}, **kw)
    model = SimpleNamespace(config=ft.model.config, parameters=lambda: iter(()))  # as if all on the GPU
    on_gpu = SimpleNamespace(model=model, decoder=ft.decoder, device=torch.device("cuda"), is_encoder_decoder=False)
    assert "sliding-window" in fixed_verify.verify_step_blocker(on_gpu, BLOCK, {}, **kw)
    assert fixed_verify.fixed_verify_rows(None, on_gpu, BLOCK, {}, expansion=0, **kw) is None


def test_fixed_self_cache_writes_at_the_index_and_masks_later_rows():
    cache = fixed_verify.FixedSelfCache(
        num_layers=1, heads=1, head_dim=2, positions=6, dtype=torch.float32, device=torch.device("cpu")
    )
    cache.write_index = torch.tensor([2, 3])
    keys, values = cache.update(torch.ones(1, 1, 2, 2), 2 * torch.ones(1, 1, 2, 2), 0)
    assert keys[0, 0, :, 0].tolist() == [0, 0, 1, 1, 0, 0] and values[0, 0, 2, 1] == 2
    mask = cache.keep_mask(torch.tensor([2, 3]), torch.float32, torch.ones(6, dtype=torch.bool))[0, 0]
    assert (mask[0, :3] == 0).all() and (mask[0, 3:] < -1e30).all() and (mask[1, :4] == 0).all()
    padded = cache.keep_mask(torch.tensor([2, 3]), torch.float32, torch.tensor([0, 1, 1, 1, 1, 1]).bool())[0, 0]
    assert (padded[:, 0] < -1e30).all() and (padded[0, 1:3] == 0).all() and (padded[1, 1:4] == 0).all()


def _decoder_only_cases():
    tok = tiny.build_tokenizer()
    text = tiny.sharpen(tiny.build_text_target(tok, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1))
    yield "text", text, {"input_ids": torch.tensor([[5, 17, 99, 42, 7, 13, 64]])}
    asr, _, inputs = tiny_qwen3_asr_prompt()
    yield "speech LLM (Qwen3-ASR)", asr, inputs


@pytest.mark.parametrize("case", [0, 1])
@pytest.mark.slow  # 19 s on 2 busy cores
def test_fixed_shape_verify_of_decoder_only_targets_decodes_as_the_growing_cache(case):
    name, model, inputs = list(_decoder_only_cases())[case]
    ft = FrozenTarget(model)
    ref = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    start = inputs["input_ids"].shape[1]
    for right in (0, 1, BLOCK - 1):

        def draft(right=right):
            cfg = DFlashConfig.from_target_config(
                ft.text_config, mask_token_id=262, num_hidden_layers=1, block_size=BLOCK
            )
            torch.manual_seed(0)
            return scripted_draft(DFlashDraftModel(cfg).eval(), ref, start, right)

        eager = speculative_generate(draft(), model, 20, **inputs)
        fixed = speculative_generate(draft(), model, 20, verify_cuda_graph=True, **inputs)
        assert torch.equal(fixed.sequences, eager.sequences) and torch.equal(eager.sequences, ref), (name, right)
        assert fixed.acceptance_lengths == eager.acceptance_lengths and fixed.verify_step == "fixed-shape, no graph"
    assert eager.acceptance_lengths[0] == BLOCK, name
