"""The encoder-context opt-in for Whisper drafts (outside the published contract): built from the target's own
cross-attention, trained through the objective, exported with its remote code and card note, decoded losslessly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModel, WhisperForConditionalGeneration
from utils import TINY_WHISPER_MASK as MASK
from utils import make_args, tiny_text_target, tiny_whisper, whisper_features

from dflash_hf import speculative_generate
from dflash_hf.export.drafts import export_draft, load_draft_strict
from dflash_hf.export.hub import DraftCardInfo, build_model_card
from dflash_hf.generation.speculative import dflash_custom_generate
from dflash_hf.targets.builder import build_target_and_draft
from dflash_hf.targets.draft_checks import check_encoder_context
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny
from dflash_hf.training.assembly import target_and_draft


@pytest.fixture(scope="module")
def whisper():
    return tiny_whisper()


def _draft(tmp_path, model, **kw):
    args = make_args(tmp_path, mask_token_id=MASK, num_draft_layers=2, draft_encoder_context=True, **kw)
    torch.manual_seed(0)
    return build_target_and_draft(FrozenTarget(model), args).draft.eval()


def test_fresh_draft_takes_the_cross_attention_of_the_targets_top_decoder_layers(whisper, tmp_path):
    model, _ = whisper
    draft = _draft(tmp_path, model)
    assert draft.config.encoder_hidden_size == model.config.d_model
    top = model.model.decoder.layers[-2:]
    for mine, theirs in zip(draft.layers, top):
        assert torch.equal(mine.encoder_attn.q_proj.weight, theirs.encoder_attn.q_proj.weight)
        assert torch.equal(mine.encoder_attn.o_proj.bias, theirs.encoder_attn.out_proj.bias)
        assert torch.equal(mine.encoder_attn.k_proj.weight, theirs.encoder_attn.k_proj.weight)
        assert torch.equal(mine.encoder_attn.layer_norm.weight, theirs.encoder_attn_layer_norm.weight)


def test_draft_reads_the_encoder_frames_and_cached_keys_give_the_same_hidden(whisper, tmp_path):
    model, processor = whisper
    draft = _draft(tmp_path, model)
    cfg = draft.config
    taps = torch.randn(1, 5, cfg.num_taps * cfg.hidden_size)
    noise = torch.randn(1, 4, cfg.hidden_size)
    pos = torch.arange(9)[None]
    frames = [model.model.encoder(whisper_features(processor, s)).last_hidden_state for s in (0, 1)]
    with torch.no_grad():
        a = draft(position_ids=pos, noise_embedding=noise, target_hidden=taps, encoder_hidden_states=frames[0])
        cache = {}
        first = draft(
            position_ids=pos,
            noise_embedding=noise,
            target_hidden=taps,
            encoder_hidden_states=frames[0],
            encoder_cache=cache,
        )
        assert sorted(cache) == [0, 1]  # one entry per layer, filled by the layers themselves
        cache = {k: (key.clone(), value) for k, (key, value) in cache.items()}
        cached = draft(
            position_ids=pos,
            noise_embedding=noise,
            target_hidden=taps,
            encoder_hidden_states=frames[0],
            encoder_cache=cache,
        )
        b = draft(position_ids=pos, noise_embedding=noise, target_hidden=taps, encoder_hidden_states=frames[1])
        poisoned = {k: (key, 2.0 * value) for k, (key, value) in cache.items()}
        from_cache = draft(
            position_ids=pos,
            noise_embedding=noise,
            target_hidden=taps,
            encoder_hidden_states=frames[0],
            encoder_cache=poisoned,
        )
    assert torch.equal(a, first) and torch.equal(a, cached)
    assert not torch.allclose(a, from_cache)  # the cached keys are what is used, not recomputed
    assert not torch.allclose(a, b)  # other audio, other proposals
    with pytest.raises(ValueError, match="encoder_hidden_states"):
        draft(position_ids=pos, noise_embedding=noise, target_hidden=taps)
    with pytest.raises(ValueError, match="one utterance's frames per row"):
        draft(
            position_ids=pos,
            noise_embedding=noise.expand(2, -1, -1),
            target_hidden=taps.expand(2, -1, -1),
            encoder_hidden_states=frames[0],
        )


@pytest.mark.compat
@pytest.mark.slow  # 42 s on 2 busy cores
def test_training_export_and_lossless_decoding_with_encoder_context(whisper, tmp_path):
    from dflash_hf.cli import train as cli_train

    target_dir = tiny.save_tiny_target(tmp_path / "target", kind="whisper", hidden_size=32, num_heads=2)
    manifest = tiny.synthesize_speech(tmp_path / "speech", 4, seed=0)
    metrics = cli_train.run(
        [
            "--target_name_or_path",
            str(target_dir),
            "--train_data",
            str(manifest),
            "--mask_token_id",
            str(MASK),
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "2",
            "--block_size",
            "4",
            "--num_draft_layers",
            "1",
            "--use_cpu",
            "true",
            "--report_to",
            "none",
            "--max_tokens",
            "400",
            "--disable_tqdm",
            "true",
            "--save_strategy",
            "no",
            "--draft_encoder_context",
            "true",
            "--learning_rate",
            "1e-2",
        ]
    )
    assert np.isfinite(metrics["train_loss"])
    export = tmp_path / "out" / "draft"
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["dflash_config"]["encoder_hidden_size"] == 32
    assert cfg["dflash_config"]["outside_published_contract"] == ["encoder_hidden_size"]
    assert (export / "modeling_dflash_encoder.py").is_file()  # the remote code travels with the export
    strict = load_draft_strict(export)
    remote = AutoModel.from_pretrained(export, trust_remote_code=True)
    trained = {k: v for k, v in strict.state_dict().items() if "encoder_attn" in k}
    assert trained and all(torch.equal(v, remote.state_dict()[k]) for k, v in trained.items())
    start = WhisperForConditionalGeneration.from_pretrained(target_dir).model.decoder.layers[-1].encoder_attn
    assert not torch.equal(strict.layers[0].encoder_attn.q_proj.weight, start.q_proj.weight)  # trained from its init

    card = build_model_card(strict.config, "me/draft", DraftCardInfo(target_id="tiny-whisper"))
    assert "Outside the published DFlash contract" in card and "encoder context" in card

    model, processor = whisper
    draft = _draft(tmp_path, model)
    for seed in (0, 1):
        feats = whisper_features(processor, seed)
        reference = model.generate(feats, max_new_tokens=20, return_dict_in_generate=True).sequences
        out = speculative_generate(draft, model, 20, input_features=feats)
        assert torch.equal(out.sequences, reference)
        assert torch.equal(
            model.generate(feats, max_new_tokens=20, custom_generate=dflash_custom_generate(draft)),
            model.generate(feats, max_new_tokens=20),
        )


def test_encoder_context_is_refused_for_decoder_only_targets(tmp_path):
    model = tiny_text_target()[0]
    with pytest.raises(ValueError, match="draft_encoder_context"):
        build_target_and_draft(FrozenTarget(model), make_args(tmp_path, mask_token_id=5, draft_encoder_context=True))


def test_a_draft_with_encoder_context_is_checked_against_the_targets_encoder_width(whisper, tmp_path):
    model, _ = whisper
    draft = _draft(tmp_path, model)
    draft.config.dflash_config["encoder_hidden_size"] = 48
    with pytest.raises(ValueError, match="encoder_hidden_size is 48"):
        check_encoder_context(draft.config, FrozenTarget(model))
    export_draft(_draft(tmp_path, model), tmp_path / "ctx")
    with pytest.raises(ValueError, match="draft_encoder_context"):
        check_encoder_context(load_draft_strict(tmp_path / "ctx").config, FrozenTarget(tiny_text_target()[0]))


def _two_utterances(model, processor, side: str):
    """Two utterances of different decoder lengths padded on `side`, prompts (4 tokens) unsupervised."""
    feats = torch.cat([whisper_features(processor, 0), whisper_features(processor, 1)])
    seqs = [
        model.generate(feats[i : i + 1], max_new_tokens=n, return_dict_in_generate=True).sequences[0]
        for i, n in ((0, 14), (1, 9))
    ]
    width = max(len(s) for s in seqs)
    ids = torch.full((2, width), 0, dtype=torch.long)
    mask, loss = torch.zeros(2, width, dtype=torch.long), torch.zeros(2, width, dtype=torch.bool)
    for r, s in enumerate(seqs):
        at = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        ids[r, at], mask[r, at] = s, 1
        loss[r, at] = torch.arange(len(s)) >= 4
    return {"input_ids": ids, "attention_mask": mask, "input_features": feats, "loss_mask": loss}


@pytest.mark.slow  # 189 s on 2 busy cores
def test_encoder_context_loss_is_invariant_to_padding_side_and_overfits_to_full_blocks(whisper, tmp_path):
    from utils import ListDataset

    from dflash_hf import DFlashTrainer

    model, processor = whisper
    args = make_args(tmp_path, mask_token_id=MASK, num_draft_layers=1, draft_encoder_context=True, block_size=4)
    trainer = DFlashTrainer(args=args, target=model, train_dataset=ListDataset([0]), data_collator=lambda _: {})
    losses = {
        side: trainer.compute_loss(trainer.model, _two_utterances(model, processor, side)).item()
        for side in ("right", "left")
    }
    assert abs(losses["right"] - losses["left"]) < 1e-5, losses

    # the classic-bug gate on the new path: overfit one utterance, then decode it in whole blocks
    sharp, _ = tiny.build_whisper_target(hidden_size=32, num_heads=2, seed=2)
    tiny.sharpen(sharp, seed=2, embed_std=1.0, layer_std=0.3)
    feats = whisper_features(processor, 0)
    full = sharp.generate(feats, max_new_tokens=40, return_dict_in_generate=True).sequences
    batch = {
        "input_ids": full,
        "attention_mask": torch.ones_like(full),
        "input_features": feats,
        "loss_mask": torch.arange(full.shape[1])[None] >= 4,
    }
    block, steps = 8, 150
    torch.manual_seed(0)
    trainer = DFlashTrainer(
        args=make_args(
            tmp_path / "fit",
            mask_token_id=MASK,
            block_size=block,
            num_draft_layers=1,
            max_steps=steps,
            per_device_train_batch_size=1,
            learning_rate=3e-3,
            label_source="target_argmax",
            draft_encoder_context=True,
        ),
        target=sharp,
        train_dataset=ListDataset([0], steps),
        data_collator=lambda _: dict(batch),
    )
    trainer.train()
    out = speculative_generate(trainer.model.eval(), sharp, 40, input_features=feats)
    assert torch.equal(out.sequences, full)
    assert out.tau >= 0.75 * block, out.acceptance_lengths


def test_a_warm_start_of_an_encoder_context_dflash2_draft_continues_from_its_export(whisper, tmp_path):
    """A trained draft warm-started again (`--init_from_pretrained` its export, as training in stages does) starts
    from its own weights (cross-attention and selector included), not from the target's layers."""
    model, _ = whisper
    trained = _draft(tmp_path, model, variant="dflash2")
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p))  # differ from any fresh initialization
    export_draft(trained, tmp_path / "trained")
    args = make_args(
        tmp_path,
        mask_token_id=None,
        num_draft_layers=2,
        draft_encoder_context=True,
        variant="dflash2",
        init_from_pretrained=str(tmp_path / "trained"),
    )
    warm = target_and_draft(FrozenTarget(model), args).draft
    expected = load_draft_strict(tmp_path / "trained").state_dict()
    got = warm.state_dict()
    assert got.keys() == expected.keys() and any("encoder_attn" in k for k in got)
    assert any("selector" in k for k in got)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    fresh = _draft(tmp_path, model, variant="dflash2").state_dict()
    assert not torch.equal(got["layers.0.encoder_attn.q_proj.weight"], fresh["layers.0.encoder_attn.q_proj.weight"])
