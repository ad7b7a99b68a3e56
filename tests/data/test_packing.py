"""Packed (THD) batches end to end: collator layout, target isolation, packed == padded, budgets."""

from __future__ import annotations

import copy

import pytest
import torch
from utils import make_args, make_trainer, random_rows, text_batch, tiny_text_target

from dflash_hf import DFlashTrainer, DFlashTrainingArguments
from dflash_hf.data import (
    BadSampleError,
    BadSamples,
    ConversationRenderer,
    PaddedCollator,
    SampleValidator,
    build_train_dataloader,
    open_source,
)
from dflash_hf.data.packing import PackingCollator, PackingSampler, pack_padded_batch
from dflash_hf.objective.blocks import valid_anchor_mask
from dflash_hf.targets.families.registry import resolve_family
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny

TOL = dict(atol=2e-5, rtol=1e-4)  # fp32: packed and padded differ only in summation order


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def text_target():
    return tiny_text_target(num_layers=3, hidden_size=32)


@pytest.fixture(scope="module")
def asr(tmp_path_factory):
    """Tiny Qwen3-ASR target, its processor, 4 synthetic utterances (validated cuts with token counts)."""
    model, processor = tiny.build_qwen3_asr_target(hidden_size=32, num_layers=3)
    manifest = tiny.synthesize_speech(tmp_path_factory.mktemp("speech"), 4, min_dur=0.6, max_dur=1.6)
    family = resolve_family(model.config)
    renderer = ConversationRenderer(processor, family)
    validator = SampleValidator(renderer, family, model.config, max_tokens=None, bad=BadSamples(skip=False))
    cuts = [validator(c) for c in open_source(manifest)]
    padded = PaddedCollator(processor, model.config, family, renderer, "left")
    return model, processor, manifest, cuts, padded


def _mask_id(tok) -> int:
    return tok.convert_tokens_to_ids(tiny.MASK_TOKEN)


def _text_docs(tok, n=3, seed=0):
    return random_rows(n, 256, prompt_len=(4, 9), resp_len=(8, 16), seed=seed)


def _fields(tmp_path, mask_id, packing: bool, **kw) -> dict:
    """`make_args` fields of these comparisons: a 1-layer draft, every anchor taken, target-argmax labels."""
    base = dict(
        output_dir=str(tmp_path / f"out{int(packing)}"),
        mask_token_id=mask_id,
        num_draft_layers=1,
        num_anchors=512,
        anchor_pad_multiple=1,
        label_source="target_argmax",
        packing=packing,
        packing_max_tokens=4096 if packing else None,
    )
    return base | kw


def _args(tmp_path, mask_id, packing: bool, **kw) -> DFlashTrainingArguments:
    return make_args(tmp_path, **_fields(tmp_path, mask_id, packing, **kw))


def _trainer(tmp_path, target_model, mask_id, packing, draft=None, **kw) -> DFlashTrainer:
    """`make_trainer` without training data (the tests feed batches to the objective) on `_args`' fields."""
    return make_trainer(tmp_path, target_model, draft=draft, **_fields(tmp_path, mask_id, packing, **kw))


# ---------------------------------------------------------------------------------------------- collator
@pytest.mark.parametrize("side", ["left", "right"])
def test_pack_padded_batch_layout(text_target, side):
    _, tok = text_target
    docs = _text_docs(tok)
    padded = text_batch(docs, tok.pad_token_id, side)
    packed = pack_padded_batch(padded, max_tokens=64, pad_to_multiple_of=16, pad_token_id=tok.pad_token_id)
    lengths = [len(p) + len(r) for p, r in docs]
    total = sum(lengths)
    assert packed["input_ids"].shape == (1, 48) and total <= 48
    assert packed["cu_seqlens"].tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert packed["cu_seqlens"].dtype == torch.int32 and packed["max_seqlen"] == max(lengths)
    assert packed["input_ids"][0, :total].tolist() == [t for p, r in docs for t in p + r]
    assert packed["loss_mask"][0, :total].tolist() == [m for p, r in docs for m in [False] * len(p) + [True] * len(r)]
    assert packed["position_ids"][0, :total].tolist() == [i for n in lengths for i in range(n)]
    assert packed["attention_mask"][0].tolist() == [1] * total + [0] * (48 - total)
    assert not packed["loss_mask"][0, total:].any() and (packed["input_ids"][0, total:] == tok.pad_token_id).all()
    with pytest.raises(ValueError, match=f"packing_max_tokens={total - 1}"):
        pack_padded_batch(padded, max_tokens=total - 1)
    holes = dict(padded, attention_mask=padded["attention_mask"].clone())
    holes["attention_mask"][0, 2] = 0
    with pytest.raises(ValueError, match="contiguous"):
        pack_padded_batch(holes)


# ---------------------------------------------------------------------------------------------- target taps
def _packed_text(tok, docs):
    return pack_padded_batch(text_batch(docs, tok.pad_token_id), pad_to_multiple_of=8, pad_token_id=tok.pad_token_id)


def test_text_target_packed_taps_equal_each_document_alone(text_target):
    model, tok = text_target
    docs = _text_docs(tok)
    packed = _packed_text(tok, docs)
    ft = FrozenTarget(model)
    # Packed rows reach the target with position_ids and no 2D attention_mask / cu_seqlens / max_seqlen / loss_mask;
    # the sdpa decoder gets the packed row's 4D mask prebuilt (FrozenTarget.packed_sdpa_mask).
    inputs = ft.target_inputs(packed)
    assert sorted(inputs) == ["attention_mask", "input_ids", "position_ids"] and inputs["attention_mask"].dim() == 4
    layers = [0, 1, 2]
    taps = ft.capture(packed, layers, keep_final=True)
    cu = packed["cu_seqlens"].tolist()
    for d, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        alone = ft.capture(text_batch(docs[d : d + 1], tok.pad_token_id), layers, keep_final=True)
        torch.testing.assert_close(taps.taps[0, s:e], alone.taps[0], **TOL)
        torch.testing.assert_close(taps.final_hidden[0, s:e], alone.final_hidden[0], **TOL)


def test_qwen3_asr_packed_taps_equal_each_document_alone(asr):
    """Several audios in one row: the encoder runs per audio and masked_scatter fills the placeholders in order."""
    model, processor, _, cuts, collate = asr
    padded = collate(cuts)
    packed = pack_padded_batch(padded)
    audio_id = model.config.audio_token_id
    assert packed["input_features"].shape[0] == len(cuts) and (packed["input_ids"] == audio_id).sum() > 0
    ft = FrozenTarget(model)
    taps = ft.capture(packed, [0, 2]).taps
    cu = packed["cu_seqlens"].tolist()
    for d, cut in enumerate(cuts):
        # Alone = the same processor outputs (the feature extractor's values depend on the batch's padding).
        real = padded["attention_mask"][d].bool()
        alone = {
            "input_ids": padded["input_ids"][d, real][None],
            "attention_mask": torch.ones(1, int(real.sum())),
            "input_features": padded["input_features"][d : d + 1],
            "input_features_mask": padded["input_features_mask"][d : d + 1],
        }
        ref = ft.capture(alone, [0, 2]).taps[0]
        assert ref.shape[0] == cu[d + 1] - cu[d] == cut.custom["dflash_num_tokens"]
        torch.testing.assert_close(taps[0, cu[d] : cu[d + 1]], ref, **TOL)


# ---------------------------------------------------------------------------------------------- packed == padded
def _loss_and_grads(trainer: DFlashTrainer, batch: dict):
    trainer.model.zero_grad()
    plan = trainer.objective.plan(trainer.target, batch, seed=0)
    loss = trainer.compute_loss(trainer.model, dict(batch), plan=plan)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in trainer.model.named_parameters()}
    return loss.detach(), grads, plan


@pytest.mark.parametrize("kind", ["text", "qwen3_asr"])
def test_packed_and_padded_give_same_loss_and_gradients(tmp_path, kind, text_target, asr):
    """Same documents, all valid anchors taken (num_anchors >= #valid): packed loss and draft gradients equal the
    padded ones to fp32 round-off (atol 2e-5, rtol 1e-4). The ASR padded batch is left-padded."""
    if kind == "text":
        model, tok = text_target
        docs = _text_docs(tok, n=4, seed=1)
        padded, packed = text_batch(docs, tok.pad_token_id, "left"), _packed_text(tok, docs)
        mask_id = _mask_id(tok)
    else:
        model, processor, _, cuts, collate = asr
        padded, packed = collate(cuts), PackingCollator(collate, 4096, pad_to_multiple_of=8)(cuts)
        mask_id = _mask_id(processor.tokenizer)
    t_pad = _trainer(tmp_path, model, mask_id, packing=False)
    t_pack = _trainer(tmp_path, model, mask_id, packing=True, draft=copy.deepcopy(t_pad.model))
    loss_pad, g_pad, plan_pad = _loss_and_grads(t_pad, padded)
    loss_pack, g_pack, plan_pack = _loss_and_grads(t_pack, packed)
    n_valid = int(valid_anchor_mask(plan_pack.loss_mask, plan_pack.doc_ids).sum())
    assert n_valid > 10 and int(plan_pack.anchors.ge(0).sum()) == int(plan_pad.anchors.ge(0).sum()) == n_valid
    assert plan_pack.doc_ids.max() == padded["input_ids"].shape[0] - 1
    torch.testing.assert_close(plan_pack.denominator, plan_pad.denominator)
    assert loss_pack.item() > 0.1
    torch.testing.assert_close(loss_pack, loss_pad, **TOL)
    for k in g_pad:
        assert g_pad[k].abs().max() > 0, k
        torch.testing.assert_close(g_pack[k], g_pad[k], **TOL, msg=k)


# ---------------------------------------------------------------------------------------------- isolation
def test_no_attention_leak_across_documents(tmp_path, text_target):
    """Perturbing document 0 changes its own taps and blocks, and nothing of documents 1 and 2."""
    model, tok = text_target
    docs = _text_docs(tok, seed=2)
    trainer = _trainer(tmp_path, model, _mask_id(tok), packing=True)
    hidden = {}
    trainer.model.norm.register_forward_hook(lambda _m, _a, out: hidden.__setitem__("h", out.detach()))

    def run(batch):
        plan = trainer.objective.plan(trainer.target, batch, seed=0)
        trainer.objective.loss(trainer.model, trainer.target, batch, plan)
        taps = trainer.target.capture(batch, trainer.draft_config.target_layer_ids).taps[0]
        return taps, hidden["h"][0].view(plan.anchors.shape[1], 4, -1), plan

    base = _packed_text(tok, docs)
    other = dict(base, input_ids=base["input_ids"].clone())
    end0 = int(base["cu_seqlens"][1])
    other["input_ids"][0, : end0 - 1] = torch.randint(3, 256, (end0 - 1,), generator=torch.Generator().manual_seed(9))
    taps_a, blocks_a, plan = run(base)
    taps_b, blocks_b, plan_b = run(other)
    assert torch.equal(plan.anchors, plan_b.anchors)
    block_doc = plan.doc_ids[0, plan.anchors[0]]  # [N]
    assert (block_doc == 0).any() and (block_doc > 0).any()
    assert (taps_a[:end0] - taps_b[:end0]).abs().max() > 1e-3
    assert (blocks_a[block_doc == 0] - blocks_b[block_doc == 0]).abs().max() > 1e-4
    torch.testing.assert_close(taps_a[end0:], taps_b[end0:], atol=1e-6, rtol=0)
    torch.testing.assert_close(blocks_a[block_doc > 0], blocks_b[block_doc > 0], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------- anchors, checks
def test_anchor_budget_caps_packed_micro_batch(tmp_path, text_target):
    model, tok = text_target
    packed = _packed_text(tok, _text_docs(tok, n=4, seed=3))
    capped = _trainer(tmp_path, model, _mask_id(tok), packing=True, num_anchors=6, anchor_budget=9)
    free = _trainer(tmp_path, model, _mask_id(tok), packing=True, num_anchors=6)
    plan_free = free.objective.plan(free.target, packed, seed=1)
    plan = capped.objective.plan(capped.target, packed, seed=1)
    per_doc = torch.bincount(plan_free.doc_ids[0, plan_free.anchors[0]], minlength=4)
    assert per_doc.tolist() == [6, 6, 6, 6]  # num_anchors applies per document
    chosen = plan.anchors[0][plan.anchors[0] >= 0]
    assert len(chosen) == 9 and valid_anchor_mask(plan.loss_mask, plan.doc_ids)[0, chosen].all()


def test_packing_checks_are_clear(tmp_path, text_target):
    model, tok = text_target
    mask_id = _mask_id(tok)
    with pytest.raises(ValueError, match="packing_max_tokens"):
        _args(tmp_path, mask_id, packing=True, packing_max_tokens=None)
    with pytest.raises(ValueError, match="anchor_budget"):
        _args(tmp_path, mask_id, packing=False, anchor_budget=8)
    docs = _text_docs(tok)
    trainer = _trainer(tmp_path, model, mask_id, packing=False)
    with pytest.raises(ValueError, match="packing=False"):
        trainer.objective.plan(trainer.target, _packed_text(tok, docs), seed=0)
    trainer = _trainer(tmp_path, model, mask_id, packing=True)
    with pytest.raises(ValueError, match="padded batch"):
        trainer.objective.plan(trainer.target, text_batch(docs, tok.pad_token_id), seed=0)
    unsafe = copy.deepcopy(model)
    unsafe.config._attn_implementation = "paged|sdpa"
    with pytest.raises(ValueError, match="attn_implementation"):
        _trainer(tmp_path, unsafe, mask_id, packing=True)


# ---------------------------------------------------------------------------------------------- loader budget
def test_loader_packs_within_budget_and_skips_too_long(tmp_path, asr):
    model, processor, manifest, cuts, _ = asr
    longest = max(c.custom["dflash_num_tokens"] for c in cuts)
    budget = longest + 20
    loader = build_train_dataloader(manifest, processor, model.config, max_tokens=budget, packing=True, seed=3)
    n_docs = 0
    for batch in loader:
        assert batch["input_ids"].shape[0] == 1 and int(batch["attention_mask"].sum()) <= budget
        assert batch["input_features"].shape[0] == len(batch["cu_seqlens"]) - 1
        n_docs += len(batch["cu_seqlens"]) - 1
    assert n_docs == len(cuts)  # nothing dropped
    tight = longest - 1  # the longest conversation no longer fits
    with pytest.raises(BadSampleError, match="max_tokens"):
        list(build_train_dataloader(manifest, processor, model.config, max_tokens=tight, packing=True))
    loader = build_train_dataloader(
        manifest, processor, model.config, max_tokens=tight, packing=True, skip_bad_samples=True
    )
    n_docs = sum(len(b["cu_seqlens"]) - 1 for b in loader)
    assert loader.bad_samples.num_skipped >= 1 and n_docs + loader.bad_samples.num_skipped == len(cuts)


def test_packing_sampler_best_fit_and_rank_sharding(asr):
    _, _, _, cuts, _ = asr
    lengths = {c.id: c.custom["dflash_num_tokens"] for c in cuts}
    budget = 2 * max(lengths.values())
    packs = [list(p) for p in PackingSampler(cuts, budget, shuffle=False)]
    assert sorted(c.id for p in packs for c in p) == sorted(lengths)
    assert all(sum(lengths[c.id] for c in p) <= budget for p in packs) and len(packs) < len(cuts)
    ranks = [PackingSampler(cuts, budget, shuffle=False, world_size=2, rank=r) for r in (0, 1)]
    seen = [[c.id for p in s for c in p] for s in ranks]
    assert not set(seen[0]) & set(seen[1])
    assert len(seen[0]) + len(seen[1]) + sum(len(p) for p in packs[len(packs) // 2 * 2 :]) == len(cuts)
    assert ranks[0].dropped_packs == len(packs) % 2
    with pytest.raises(ValueError, match="packing_max_tokens"):
        list(PackingSampler(cuts, min(lengths.values()) - 1))
