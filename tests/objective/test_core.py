"""Core semantics: taps, masks, backends, loss invariances, the overfit gate and lossless decoding."""

from __future__ import annotations

import pytest
import torch
from utils import assert_lossless_greedy, make_trainer, random_rows, text_batch, tiny_text_target

from dflash_hf import (
    DFlash2DraftModel,
    DFlashConfig,
    DFlashDraftModel,
    speculative_generate,
)
from dflash_hf.objective.blocks import (
    attention_mask_for,
    build_blocks,
    dense_block_mask,
    doc_ids_from,
    flex_block_mask,
    row_positions,
    sample_anchors,
)
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny
from dflash_hf.testing.tiny import sharpen


def make_draft(target: FrozenTarget, mask_id: int, block_size: int = 4, layers: int = 2, seed: int = 0):
    cfg = DFlashConfig.from_target_config(
        target.text_config, mask_token_id=mask_id, num_hidden_layers=layers, block_size=block_size
    )
    torch.manual_seed(seed)
    return DFlashDraftModel(cfg).eval()


@pytest.mark.compat
def test_taps_are_pre_norm_decoder_layer_outputs():
    model, _ = tiny_text_target()
    ft = FrozenTarget(model)
    ids = torch.randint(3, 250, (2, 9))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    feats = ft.capture(batch, [0, 2, 3], keep_final=True)
    ref = model(**batch, output_hidden_states=True).hidden_states  # ref[k+1] = output of layer k (k < L-1)
    h = ft.hidden_size
    torch.testing.assert_close(feats.taps[..., :h], ref[1])
    torch.testing.assert_close(feats.taps[..., h : 2 * h], ref[3])
    # HF's last entry is post-norm; our tap of the last layer is pre-norm and norms to it.
    torch.testing.assert_close(feats.final_hidden, ref[4])
    torch.testing.assert_close(ft.final_norm(feats.taps[..., 2 * h :]), ref[4])
    assert not torch.allclose(feats.taps[..., 2 * h :], ref[4])


def _random_block_inputs(draft, seed=0, b=2, s=20, n=3):
    g = torch.Generator().manual_seed(seed)
    cfg = draft.config
    taps = torch.randn(b, s, cfg.num_taps * cfg.hidden_size, generator=g)
    am = torch.ones(b, s, dtype=torch.long)
    am[1, 15:] = 0
    pos_ids = None
    ids = torch.randint(3, 200, (b, s), generator=g)
    anchors = torch.tensor([[3, 9, 14], [5, 11, -1]])
    doc = doc_ids_from(am, pos_ids)
    blocks = build_blocks(ids, ids, am.bool(), doc, row_positions(am), anchors, cfg.block_size, cfg.mask_token_id, 4.0)
    noise = torch.randn(b, n * cfg.block_size, cfg.hidden_size, generator=g)
    return taps, doc, blocks, noise


def _draft_hidden(draft, taps, doc, blocks, noise, backend):
    b, n, bs = blocks.ids.shape
    mask = attention_mask_for(backend, blocks.anchors, doc, bs)
    pos = torch.cat([row_positions(doc >= 0), blocks.positions.view(b, -1)], 1)
    return draft(position_ids=pos, attention_mask=mask, noise_embedding=noise, target_hidden=taps).view(b, n, bs, -1)


@pytest.fixture
def block_setup():
    """A fresh random draft and hand-placed blocks over random taps (see `_random_block_inputs`)."""
    model, tok = tiny_text_target()
    draft = make_draft(FrozenTarget(model), tok.convert_tokens_to_ids(tiny.MASK_TOKEN))
    return (draft, *_random_block_inputs(draft))


def test_flex_and_dense_masks_give_the_same_hidden(block_setup):
    draft, taps, doc, blocks, noise = block_setup
    with torch.no_grad():
        dense = _draft_hidden(draft, taps, doc, blocks, noise, "sdpa")
        flex = _draft_hidden(draft, taps, doc, blocks, noise, "flex")
    valid = blocks.anchor_valid
    torch.testing.assert_close(flex[valid], dense[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("block_size", [4, 7, 16])
def test_flex_tile_layout_equals_create_block_mask(packed, block_size):
    """The tile layout planned on the host from the anchors is bit-identical to the one `create_block_mask`
    derives from the dense mask (kv- and q-major, partial and full tiles): the kernel gets the same BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(block_size + packed)
    for trial in range(4):
        b, s = 1 + trial % 3, int(torch.randint(60, 600, (1,), generator=g))
        lengths = torch.randint(s // 2, s + 1, (b,), generator=g)
        lengths[0] = s
        am = (torch.arange(s)[None] < lengths[:, None]).long()
        pos = None
        if packed:  # three document boundaries per row
            pos = torch.stack(
                [
                    torch.cat([torch.arange(e - a) for a, e in zip([0, *cuts], [*cuts, s])])
                    for cuts in (sorted(torch.randint(1, s, (3,), generator=g).unique().tolist()) for _ in range(b))
                ]
            )
        doc = doc_ids_from(am, pos)
        loss_mask = am.bool() & (torch.rand(b, s, generator=g) < 0.8)
        anchors = sample_anchors(
            loss_mask,
            doc,
            int(torch.randint(1, 60, (1,), generator=g)),
            generator=g,
            per_document=packed,
            pad_multiple=8,
        )
        n = anchors.shape[1]
        dense = dense_block_mask(anchors, doc, block_size)[:, 0]
        ref = create_block_mask(
            lambda bi, hi, q, kv, m=dense: m[bi, q, kv],
            B=b,
            H=None,
            Q_LEN=n * block_size,
            KV_LEN=s + n * block_size,
            device="cpu",
            BLOCK_SIZE=128,
        )
        mine = flex_block_mask(anchors, doc, block_size)
        assert mine.seq_lengths == ref.seq_lengths
        for name in (
            "kv_num_blocks",
            "kv_indices",
            "full_kv_num_blocks",
            "full_kv_indices",
            "q_num_blocks",
            "q_indices",
            "full_q_num_blocks",
            "full_q_indices",
        ):
            assert torch.equal(getattr(mine, name), getattr(ref, name)), (trial, name)


def test_block_sees_only_context_before_its_anchor_and_its_own_block(block_setup):
    draft, taps, doc, blocks, noise = block_setup
    with torch.no_grad():
        base = _draft_hidden(draft, taps, doc, blocks, noise, "sdpa")

        def changed(taps2=taps, noise2=noise):
            out = _draft_hidden(draft, taps2, doc, blocks, noise2, "sdpa")
            return (out - base).abs().amax(dim=(-1, -2))  # [b, N]: how much each block moved

        t = taps.clone()
        t[0, 9] += 5.0  # == anchor of block 1 of row 0: must not be visible to it (strictly before)
        d = changed(t)
        assert d[0, 0] == 0 and d[0, 1] == 0 and d[0, 2] > 1e-4 and d[1].max() == 0
        t = taps.clone()
        t[0, 8] += 5.0  # just before anchor 9: visible to blocks 1 and 2, not block 0
        d = changed(t)
        assert d[0, 0] == 0 and d[0, 1] > 1e-4 and d[0, 2] > 1e-4
        t = taps.clone()
        t[1, 16:] += 5.0  # padding of row 1
        assert changed(t).max() == 0
        nz = noise.clone()
        nz[0, 4 * 1 + 2] += 5.0  # a slot of block 1: moves block 1 only (bidirectional inside it)
        d = changed(noise2=nz)
        assert d[0, 1] > 1e-4 and d[0, 0] == 0 and d[0, 2] == 0
        nz = noise.clone()
        nz[0, 4 * 1 + 3] += 5.0  # last slot also moves earlier slots of its block (no causal mask)
        out = _draft_hidden(draft, taps, doc, blocks, nz, "sdpa")
        assert (out[0, 1, 0] - base[0, 1, 0]).abs().max() > 1e-5


def test_loss_invariant_to_padding_side_and_padded_feature_values(tmp_path):
    model, tok = tiny_text_target()
    rows = random_rows(4, 256, seed=3)
    trainer = make_trainer(tmp_path, model, tok, rows)
    losses = {}
    for side in ("right", "left"):
        batch = text_batch(rows, tok.pad_token_id, side)
        losses[side] = trainer.compute_loss(trainer.model, dict(batch)).item()
    assert abs(losses["right"] - losses["left"]) < 1e-5, losses
    # Garbage in the target features at padded positions must not change anything.
    capture = trainer.target.capture

    def noisy_capture(batch, layer_ids, keep_final=False, **kw):
        feats = capture(batch, layer_ids, keep_final, **kw)
        pad = batch["attention_mask"] == 0
        feats.taps[pad] = torch.randn_like(feats.taps[pad]) * 1e3
        return feats

    trainer.target.capture = noisy_capture
    batch = text_batch(rows, tok.pad_token_id, "left")
    assert abs(trainer.compute_loss(trainer.model, dict(batch)).item() - losses["right"]) < 1e-5


def _one_sgd_step(tmp_path, model, tok, rows, batch_size, accum):
    trainer = make_trainer(
        tmp_path,
        model,
        tok,
        rows,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accum,
        optim="sgd",
        learning_rate=1.0,
        max_grad_norm=0.0,
    )
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    return {k: before[k] - v.detach() for k, v in trainer.model.named_parameters()}, trainer


@pytest.mark.slow  # 6 s on 2 busy cores
def test_loss_invariant_to_micro_batch_split(tmp_path):
    """One optimizer step on a global batch of 4 equals 2x2 and 4x1 gradient accumulation."""
    model, tok = tiny_text_target()
    rows = random_rows(4, 256, seed=5)
    ref, _ = _one_sgd_step(tmp_path, model, tok, rows, 4, 1)
    for bs, acc in ((2, 2), (1, 4)):
        grads, _ = _one_sgd_step(tmp_path, model, tok, rows, bs, acc)
        for k in ref:
            torch.testing.assert_close(grads[k], ref[k], atol=1e-6, rtol=1e-4, msg=f"{k} ({bs}x{acc})")


@pytest.mark.compat
@pytest.mark.slow  # overfits to accept full blocks: ~8-10 s
@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_overfit_one_sequence_then_accept_full_blocks(tmp_path, variant):
    """The classic-bug gate: labels shifted by one, `<=` in the context mask, wrong RoPE positions, a
    tap/feature mismatch between training and inference, DFlash2 convolutions crossing blocks or selector
    predecessors that differ from the inference walk all leave acceptance near 1."""
    model, tok = tiny_text_target()
    sharpen(model)
    prompt = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(0))
    full = model.generate(
        input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=48, do_sample=False, eos_token_id=None
    )
    response = full[0, 12:].tolist()
    assert len(set(response)) > 10  # a varied sequence, not one repeated token
    block, steps = 8, {"dflash": 200, "dflash2": 150}[variant]
    extra = {}
    if variant == "dflash2":
        extra = dict(conv_group_size=16, selector_rank=32, selector_top_k=16, logging_steps=50)
    trainer = make_trainer(
        tmp_path,
        model,
        tok,
        [(prompt[0].tolist(), response)],
        variant=variant,
        block_size=block,
        per_device_train_batch_size=1,
        max_steps=steps,
        learning_rate={"dflash": 2e-3, "dflash2": 3e-3}[variant],
        repeat=steps,
        **extra,
    )
    trainer.train()
    draft = trainer.model.eval()
    if variant == "dflash2":
        logged = [h for h in trainer.state.log_history if "loss" in h][-1]  # the last 50 steps
        assert logged["selector_accuracy"] > 0.9 and logged["candidate_recall"] > 0.9, logged
        assert isinstance(draft, DFlash2DraftModel)
        assert draft.candidate_selector.successor_codebook.abs().sum() > 0  # the selector was trained
    model.generation_config.eos_token_id = None
    out = speculative_generate(draft, model, 48, input_ids=prompt, attention_mask=torch.ones_like(prompt))
    assert torch.equal(out.sequences, full)
    assert out.tau >= 0.9 * block, out.acceptance_lengths


@pytest.mark.compat
@pytest.mark.slow  # 9 s on 2 busy cores
def test_greedy_speculative_decoding_is_lossless_text():
    model, tok = tiny_text_target(seed=1)
    sharpen(model, seed=1)
    ft = FrozenTarget(model)
    draft = make_draft(ft, tok.convert_tokens_to_ids(tiny.MASK_TOKEN), block_size=5)
    assert_lossless_greedy(draft, model, num_prompts=3, max_new_tokens=25)


@pytest.mark.compat
def test_greedy_speculative_decoding_is_lossless_audio():
    tok = tiny.build_tokenizer()
    model, processor = tiny.build_qwen3_asr_target(tok, seed=2)
    sharpen(model, seed=2)
    ft = FrozenTarget(model)
    draft = make_draft(ft, tok.convert_tokens_to_ids(tiny.MASK_TOKEN), block_size=4)
    conv = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Transcribe."}]}]
    text = processor.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    audio = 0.1 * torch.randn(17000, generator=torch.Generator().manual_seed(0))
    inputs = processor(text=[text], audio=[audio.numpy()], sampling_rate=16000, return_tensors="pt")
    ref = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    out = speculative_generate(draft, model, 20, **inputs)
    assert torch.equal(out.sequences, ref)
