"""Tree decoding (`speculative_generate(..., tree_budget=n)`, `custom_generate`) is lossless for every target family
we decode: greedy output equals the target's own greedy decoding (text LLM, padded left and right; Qwen3-ASR with
processor-expanded audio, padded; the other speech LLM rows; the model-side single-placeholder layout; Whisper and
Moonshine through `custom_generate`), over the growing cache and the fixed-shape verify, the eager draft and its
fixed-shape step. A tree of `block_size - 1` nodes decodes as the chain, and a larger one accepts at least what the
chain accepts from each draft forward."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from utils import REPO_ROOT, loaded_script, tiny_qwen3_asr_prompt, tiny_whisper, whisper_draft, whisper_features

from dflash_hf import DFlash2DraftModel, DFlashConfig, DFlashDraftModel, speculative_generate
from dflash_hf.generation.model_side import model_side_greedy
from dflash_hf.generation.speculative import dflash_custom_generate
from dflash_hf.generation.tree import SlotScores
from dflash_hf.targets.families.registry import FAMILIES, encode_batch
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny

pytestmark = pytest.mark.compat  # run on every transformers version CI tests

BLOCK = 4
NEW = 20


def _rank(position: int, slot: int) -> int:
    """Where the oracle ranks the reference's token: mostly second at the first slot (the chain then accepts
    nothing), first or second after it."""
    if slot == 0:
        return 1 if position % 3 else 0
    return 1 if (position + slot) % 5 == 0 else 0


def oracle_draft(draft, reference: torch.Tensor, start: int, vocab: int):
    """`draft` with slot scores that rank `reference`'s next tokens by `_rank` (a function of the anchor's position
    only, so the chain and a tree see the same scores from the same position): its chain (`propose_block`) and its
    tree's slots (`tree_scores`) both read them. `reference[0, start]` is the first anchor; `draft.anchors` records
    each cycle's anchor index."""
    state, forward = {}, draft.forward
    draft.anchors = []

    def recording(*args, position_ids=None, **kwargs):
        first = int(position_ids.reshape(-1)[-BLOCK])  # the block's first position: the anchor's
        state.setdefault("offset", start - first)
        draft.anchors.append(first + state["offset"])
        return forward(*args, position_ids=position_ids, **kwargs)

    def logits(hidden):
        p, n = draft.anchors[-1], hidden.shape[0] - 1
        out = torch.zeros(n, vocab)
        for i in range(n):
            t = int(reference[0, p + 1 + i]) if p + 1 + i < reference.shape[1] else 0
            out[i, t] = 10.0
            for j in range(_rank(p, i)):
                out[i, (t + 1 + j) % vocab] = 11.0 - 0.5 * j
        return out

    draft.forward = recording
    draft.propose_block = lambda hidden, lm_head, anchor, temperature, generator: (logits(hidden).argmax(-1), None)
    draft.tree_scores = lambda hidden, lm_head, anchor: SlotScores(logits(hidden))
    return draft


def _text_draft(ft, seed=0, variant="dflash", mask_id=3):
    extra = dict(variant="dflash2", conv_group_size=8, selector_top_k=4) if variant == "dflash2" else {}
    cfg = DFlashConfig.from_target_config(
        ft.text_config, mask_token_id=mask_id, num_hidden_layers=1, block_size=BLOCK, **extra
    )
    cfg.vocab_size = ft.vocab_size
    torch.manual_seed(seed)
    return (DFlash2DraftModel if extra else DFlashDraftModel)(cfg).eval()


def _text_case(padding: str | None):
    tok = tiny.build_tokenizer()
    model = tiny.sharpen(tiny.build_text_target(tok, num_layers=4, hidden_size=64, seed=3), seed=3)
    if padding is None:
        inputs = dict(tok(["the quick brown fox"], return_tensors="pt"))
    else:
        tok.padding_side = padding
        inputs = dict(tok(["the quick brown fox"], padding="max_length", max_length=24, return_tensors="pt"))
    ref = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    return model, inputs, ref, inputs["input_ids"].shape[1], _text_draft(FrozenTarget(model))


def _asr_case(padding: str | None):
    asr, processor, inputs = tiny_qwen3_asr_prompt()
    if padding is not None:
        conv = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Transcribe."}]}]
        rendered = processor.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        processor.tokenizer.padding_side = padding
        n = inputs["input_ids"].shape[1]
        inputs = dict(
            processor(
                text=[rendered],
                audio=[np.zeros(16000, np.float32) + 0.05],
                sampling_rate=16000,
                return_tensors="pt",
                padding="max_length",
                max_length=n + 5,
            )
        )
    ref = asr.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    return asr, inputs, ref, inputs["input_ids"].shape[1], _text_draft(FrozenTarget(asr), mask_id=262)


def _model_side_case(_):
    with loaded_script(REPO_ROOT / "tests" / "targets" / "test_families.py") as families:
        tok = tiny.build_tokenizer()
        torch.manual_seed(0)
        model, processor = families.build_qwen2_audio(tok)
    tiny.sharpen(model.get_decoder(), seed=1)
    family = FAMILIES["qwen2_audio_single_placeholder"]
    text = "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>Transcribe.<|im_end|>\n<|im_start|>assistant\n"
    audio = (0.1 * np.random.default_rng(0).standard_normal(12000)).astype(np.float32)
    inputs = encode_batch(family, processor, model.config, [text], [audio])
    ft = FrozenTarget(model, family.name)
    ref = model_side_greedy(ft, NEW, **inputs)
    return ft, inputs, ref, inputs["input_ids"].shape[1], _text_draft(ft, mask_id=262)


def _whisper_case(_):
    model, processor = tiny_whisper()
    feats = whisper_features(processor, 0)
    ref = model.generate(feats, max_new_tokens=NEW, return_dict_in_generate=True).sequences
    return model, {"input_features": feats}, ref, 4, whisper_draft(model)


def _moonshine_case(_):
    with loaded_script(REPO_ROOT / "tests" / "targets" / "test_moonshine.py") as moonshine:
        model, processor = moonshine.build_moonshine(seed=2)
        values = torch.from_numpy(moonshine._audio(1, 0.7))[None]
        draft = moonshine._draft(FrozenTarget(model), processor)
    ref = model.generate(input_values=values, max_new_tokens=NEW, return_dict_in_generate=True).sequences
    return model, {"input_values": values}, ref, 1, draft


CASES = {
    "text": (_text_case, None, True),
    "text, left-padded": (_text_case, "left", True),
    "text, right-padded": (_text_case, "right", True),
    "qwen3_asr": (_asr_case, None, True),
    "qwen3_asr, left-padded": (_asr_case, "left", True),
    "qwen3_asr, right-padded": (_asr_case, "right", True),
    "model-side placeholder": (_model_side_case, None, True),
    "whisper": (_whisper_case, None, True),
    "moonshine": (_moonshine_case, None, False),  # the fixed-shape verify is Whisper's and decoder-only targets'
}


@pytest.mark.parametrize("case", list(CASES))
def test_tree_decoding_is_the_target_greedy_decoding(case):
    build, padding, fixed_ok = CASES[case]
    model, inputs, ref, start, draft = build(padding)
    ft = model if isinstance(model, FrozenTarget) else FrozenTarget(model)
    assert ref.shape[1] > start + 8
    vocab = ft.vocab_size

    def decode(budget, **kw):
        oracle = oracle_draft(copy.deepcopy(draft), ref, start, vocab)
        out = speculative_generate(oracle, model, NEW, tree_budget=budget, **kw, **inputs)
        assert torch.equal(out.sequences, ref), (case, budget, kw)
        return out, oracle.anchors

    chain, _ = decode(None)
    as_chain, _ = decode(BLOCK - 1)  # a tree of block_size - 1 nodes is the chain
    assert as_chain.acceptance_lengths == chain.acceptance_lengths
    assert as_chain.num_target_forwards == chain.num_target_forwards
    tree, anchors = decode(10)
    for anchor, accepted in list(zip(anchors, tree.acceptance_lengths))[:-1]:  # the last cycle may stop early
        chain_k = next((i for i in range(BLOCK - 1) if _rank(anchor, i)), BLOCK - 1)
        assert accepted >= chain_k + 1, (anchor, accepted)
    assert tree.num_target_forwards < chain.num_target_forwards and max(tree.acceptance_lengths) == BLOCK
    if fixed_ok:
        fixed, _ = decode(10, verify_cuda_graph=True, draft_cuda_graph=True)
        assert fixed.acceptance_lengths == tree.acceptance_lengths
        assert fixed.verify_step == fixed.draft_step == "fixed-shape, no graph"
    # the draft's own slot scores (no oracle): nothing to accept but the bonus, still lossless
    own = speculative_generate(draft, model, NEW, tree_budget=10, **inputs)
    assert torch.equal(own.sequences, ref)


def test_dflash2_trees_and_custom_generate_are_lossless():
    model, inputs, ref, _, _ = _text_case(None)
    ft = FrozenTarget(model)
    draft = _text_draft(ft, variant="dflash2")
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "successor_codebook" in name or "mlp_conv" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    for kw in ({}, {"draft_cuda_graph": True, "verify_cuda_graph": True}):
        out = speculative_generate(draft, model, NEW, tree_budget=12, **kw, **inputs)
        assert torch.equal(out.sequences, ref), kw
    custom = dflash_custom_generate(draft, tree_budget=12)
    plain = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(model.generate(**inputs, max_new_tokens=NEW, do_sample=False, custom_generate=custom), plain)
    whisper, processor = tiny_whisper()
    feats = whisper_features(processor, 1)
    custom = dflash_custom_generate(whisper_draft(whisper), tree_budget=8)
    assert torch.equal(
        whisper.generate(feats, max_new_tokens=12, custom_generate=custom), whisper.generate(feats, max_new_tokens=12)
    )


def test_processors_and_stop_tokens_act_as_in_the_chain():
    """A repetition penalty (a processor that reads each row's ids: run per node) and an end token accepted inside
    a tree's path: the output is `generate`'s, ending at the end token."""
    model, inputs, ref, start, draft = _text_case(None)
    model = copy.deepcopy(model)
    model.generation_config.repetition_penalty = 1.5
    penalized = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    new = penalized[0, start:].tolist()
    j = next(j for j in range(4, NEW) if new[j] not in new[:j])
    model.generation_config.eos_token_id = new[j]
    ref = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    assert ref.shape[1] == start + j + 1
    out = speculative_generate(
        oracle_draft(draft, penalized, start, FrozenTarget(model).vocab_size), model, NEW, tree_budget=10, **inputs
    )
    assert torch.equal(out.sequences, ref) and sum(out.acceptance_lengths) == j


def test_whisper_trees_stop_at_its_last_position():
    """Near Whisper's 448 decoder positions the nodes past them are never accepted (their positions are capped):
    the output is Whisper's own up to its last position."""
    model, processor = tiny_whisper()
    model = copy.deepcopy(model)
    model.generation_config.suppress_tokens = [*model.generation_config.suppress_tokens, 256]  # no <|endoftext|>
    feats = whisper_features(processor, 0)
    prompt = torch.cat([torch.tensor([[257, 258, 359, 363]]), torch.full((1, 433), 300)], dim=1)
    ref = model.generate(feats, decoder_input_ids=prompt, max_new_tokens=11, return_dict_in_generate=True).sequences
    assert ref.shape[1] == 448
    oracle = oracle_draft(whisper_draft(model), ref, prompt.shape[1], model.config.vocab_size)
    out = speculative_generate(oracle, model, 11, tree_budget=10, input_features=feats, decoder_input_ids=prompt)
    assert torch.equal(out.sequences, ref)
    assert max(oracle.anchors) > 448 - BLOCK  # a tree whose deepest nodes would pass the last position


@pytest.mark.parametrize("draft_step", ["fixed", "eager"])
def test_the_fixed_tree_verify_takes_the_tree_in_one_tensor_from_either_draft_step(draft_step):
    """The fixed-shape verify reads the tree's ids, depths and ancestors from one tensor (`tree.verify_inputs`), made
    inside the fixed-shape draft step or, after the eager draft, by the cycle: lossless for a padded prompt, with
    trees leaving their chain (the oracle ranks the reference's token second at times)."""
    graph = draft_step == "fixed"
    model, inputs, ref, start, draft = _text_case("left")
    oracle = oracle_draft(draft, ref, start, FrozenTarget(model).vocab_size)
    out = speculative_generate(
        oracle, model, NEW, tree_budget=10, verify_cuda_graph=True, draft_cuda_graph=graph, **inputs
    )
    assert torch.equal(out.sequences, ref) and out.verify_step == "fixed-shape, no graph"
    assert out.draft_step == ("fixed-shape, no graph" if graph else "eager")
    assert max(out.acceptance_lengths) == BLOCK and len(out.acceptance_lengths) < NEW // 2


def test_tree_sampling_applies_the_target_processors():
    """At T > 0 a tree decode samples the processed distribution (Whisper's suppressed tokens never come out)."""
    model, processor = tiny_whisper()
    feats = whisper_features(processor, 1)
    greedy = model.generate(feats, max_new_tokens=12, return_dict_in_generate=True).sequences[0, 4:].tolist()
    model = copy.deepcopy(model)
    banned = sorted(set(greedy) - {processor.tokenizer.eos_token_id})
    model.generation_config.suppress_tokens = list(model.generation_config.suppress_tokens) + banned
    draft = whisper_draft(FrozenTarget(model))
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        out = speculative_generate(draft, model, 12, 1.0, gen, tree_budget=8, input_features=feats)
        new = out.sequences[0, 4:].tolist()
        assert 0 < len(new) <= 12 and not set(new) & set(banned), (new, banned)
        assert all(1 <= a <= BLOCK for a in out.acceptance_lengths)


@pytest.mark.parametrize("family", ["qwen2_audio", "voxtral", "audioflamingo3", "glmasr"])
def test_the_other_speech_families_take_the_tree_mask(family):
    """The speech LLM rows with other language models (Qwen2, Llama) take the tree's 4-D mask and positions too."""
    with loaded_script(REPO_ROOT / "tests" / "targets" / "test_families.py") as families:
        tok = tiny.build_tokenizer()
        torch.manual_seed(0)
        model, processor = families.BUILDERS[family](tok)
    tiny.sharpen(model.eval().get_decoder(), seed=1)
    text = "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>Transcribe.<|im_end|>\n<|im_start|>assistant\n"
    audio = (0.1 * np.random.default_rng(0).standard_normal(16000)).astype(np.float32)
    inputs = encode_batch(FAMILIES[family], processor, model.config, [text], [audio])
    ref = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    ft = FrozenTarget(model, family)
    for fixed in (False, True):
        oracle = oracle_draft(_text_draft(ft), ref, inputs["input_ids"].shape[1], ft.vocab_size)
        out = speculative_generate(oracle, model, NEW, tree_budget=10, verify_cuda_graph=fixed, **inputs)
        assert torch.equal(out.sequences, ref) and max(out.acceptance_lengths) == BLOCK, (family, fixed)
