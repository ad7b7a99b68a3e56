"""`build_target_and_draft`: the frozen target and its draft built and checked in one pass (a directory loaded, its
family resolved; a new draft in the run's precision; a given or warm-started draft checked against the target)."""

from __future__ import annotations

import pytest
import torch
from utils import make_args, tiny_text_target

from dflash_hf.export.drafts import export_draft, load_draft_strict
from dflash_hf.targets.builder import build_target_and_draft
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny


def test_a_target_directory_is_loaded_and_gets_a_checked_draft_in_the_runs_precision(tmp_path):
    tok = tiny.build_tokenizer()
    path = tiny.save_tiny_target(tmp_path / "target", "text", tokenizer=tok, num_layers=4, hidden_size=32)
    mask = tok.convert_tokens_to_ids(tiny.MASK_TOKEN)
    target, draft = build_target_and_draft(str(path), make_args(tmp_path, mask_token_id=mask, precision="bf16"))
    assert isinstance(target, FrozenTarget) and target.family.name == "text"
    assert target.dtype == torch.bfloat16 and {p.dtype for p in draft.parameters()} == {torch.bfloat16}
    assert draft.config.mask_token_id == mask and draft.config.vocab_size == target.vocab_size
    assert draft.config.target_layer_ids == [1, 1]  # the default taps of a 4-layer target, two draft layers


def test_no_mask_token_names_the_candidates_and_a_bad_given_draft_is_refused(tmp_path):
    model, tok = tiny_text_target(num_layers=4, hidden_size=32)
    with pytest.raises(ValueError, match=r"--mask_token_id is required(.|\n)*262 <\|dflash_mask\|>"):
        build_target_and_draft(model, make_args(tmp_path), processor=tok)
    mask = tok.convert_tokens_to_ids(tiny.MASK_TOKEN)
    _, draft = build_target_and_draft(model, make_args(tmp_path, mask_token_id=mask))
    draft.config.dflash_config["mask_token_id"] = tok.pad_token_id
    with pytest.raises(ValueError, match="equals the target's pad_token_id"):
        build_target_and_draft(model, make_args(tmp_path, mask_token_id=mask), draft=draft)


def test_a_warm_start_is_loaded_once_the_target_is_ready_and_checked_against_the_settings(tmp_path):
    model, tok = tiny_text_target(num_layers=4, hidden_size=32)
    mask = tok.convert_tokens_to_ids(tiny.MASK_TOKEN)
    _, trained = build_target_and_draft(model, make_args(tmp_path, mask_token_id=mask))
    export_draft(trained, tmp_path / "draft")
    seen = []

    def warm_start():
        seen.append(FrozenTarget.of(model).dtype)  # the target is already in the run's precision
        return load_draft_strict(tmp_path / "draft")

    args = make_args(tmp_path, init_from_pretrained=str(tmp_path / "draft"), precision="bf16")
    _, draft = build_target_and_draft(model, args, warm_start=warm_start)
    assert seen == [torch.bfloat16]
    assert all(torch.equal(a, b.to(torch.bfloat16)) for a, b in zip(draft.parameters(), trained.parameters()))
    args = make_args(tmp_path, init_from_pretrained=str(tmp_path / "draft"), variant="dflash2")
    with pytest.raises(ValueError, match="is a DFlashDraftModel but variant='dflash2'"):
        build_target_and_draft(model, args, warm_start=warm_start)
