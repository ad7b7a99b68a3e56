"""Adaptation: projection-only filter, block-size change on warm start, LoRA merged on export, resume checks."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from utils import make_trainer, random_rows, tiny_text_target

from dflash_hf import DFlashConfig, DFlashDraftModel, DFlashTrainer, DFlashTrainingArguments
from dflash_hf.export import convert_dflash_to_dflash2, export_draft, load_draft_strict
from dflash_hf.targets.draft_checks import check_warm_start
from dflash_hf.testing import tiny
from dflash_hf.training.adaptation import SELECTION_FILE, plain_draft

HIDDEN = 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target and a block-8 draft export of it (the 'published' draft to adapt)."""
    model, tok = tiny_text_target(num_layers=4, hidden_size=HIDDEN)
    mask_id = tok.convert_tokens_to_ids(tiny.MASK_TOKEN)
    config = DFlashConfig.from_target_config(model.config, mask_token_id=mask_id, num_hidden_layers=2, block_size=8)
    torch.manual_seed(1)
    base = tmp_path_factory.mktemp("base") / "draft"
    DFlashDraftModel(config).save_pretrained(base)
    rows = random_rows(8, model.config.vocab_size - 8, seed=3)
    return model, tok, base, rows


@pytest.fixture(scope="module")
def setup_dflash2(setup, tmp_path_factory):
    """The same draft bootstrapped to DFlash2, still block 8 (the shipped adapt_block8_to_block16 scenario)."""
    model, tok, base, rows = setup
    out = convert_dflash_to_dflash2(base, tmp_path_factory.mktemp("base2") / "draft", selector_rank=16)
    return model, tok, out, rows


def _trainer(setup, out: Path, **overrides) -> DFlashTrainer:
    """`make_trainer`: a block-16 warm start from the setup's export, its mask token taken from the export."""
    model, tok, base, rows = setup
    kwargs = dict(
        output_dir=str(out),
        init_from_pretrained=str(base),
        mask_token_id=None,
        block_size=16,
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        num_anchors=4,
    )
    return make_trainer(out, model, tok, rows, **(kwargs | overrides))


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _optimizer_params(trainer: DFlashTrainer) -> set[int]:
    return {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}


@pytest.mark.parametrize(("variant", "checkpointing"), [("dflash", False), ("dflash2", True)])
def test_projection_only_trains_only_fc_and_exports_block16(request, tmp_path, variant, checkpointing):
    setup = request.getfixturevalue("setup" if variant == "dflash" else "setup_dflash2")
    assert load_draft_strict(setup[2]).config.block_size == 8
    trainer = _trainer(setup, tmp_path, variant=variant, projection_only=True, activation_checkpointing=checkpointing)
    draft = trainer.model
    assert draft.config.variant == variant
    assert draft.config.block_size == 16 and trainer.block_size == 16
    before = _snapshot(draft)
    trainer.train()
    layer = draft.layers[0]
    assert layer.gradient_checkpointing is checkpointing  # enabled by Trainer.train
    if checkpointing:
        assert layer._gradient_checkpointing_func.keywords["use_reentrant"] is False
    assert _optimizer_params(trainer) == {id(draft.fc.weight)}
    after = _snapshot(draft)
    assert not torch.equal(before["fc.weight"], after["fc.weight"])
    unchanged = [n for n in before if n != "fc.weight" and torch.equal(before[n], after[n])]
    assert len(unchanged) == len(before) - 1

    export = Path(trainer.export_draft(str(tmp_path / "export")))
    saved = json.loads((export / "config.json").read_text())
    assert saved["block_size"] == 16 and saved["dflash_config"]["block_size"] == 16
    assert saved["architectures"] == [type(draft).__name__]
    reloaded = load_draft_strict(export)
    assert {n: torch.equal(p, after[n]) for n, p in reloaded.named_parameters()} == dict.fromkeys(after, True)


def test_checkpoint_keeps_all_weights_and_resume_checks_selection(setup, tmp_path):
    trainer = _trainer(setup, tmp_path, projection_only=True, max_steps=2, save_strategy="steps", save_steps=2)
    trainer.train()
    ckpt = tmp_path / "checkpoint-2"
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(trainer.model.state_dict())
    assert json.loads((ckpt / SELECTION_FILE).read_text())["trainable_parameters"] == ["fc.weight"]

    flipped = _trainer(setup, tmp_path, projection_only=False, max_steps=4)
    with pytest.raises(ValueError, match=r"different trainable-parameter selection \(projection_only.*full draft"):
        flipped.train(resume_from_checkpoint=True)

    same = _trainer(setup, tmp_path, projection_only=True, max_steps=3)
    assert same.train(resume_from_checkpoint=str(ckpt)).global_step == 3


def test_lora_trains_adapters_and_exports_merged_plain_draft(setup, tmp_path):
    trainer = _trainer(setup, tmp_path, lora_r=4, lora_alpha=8, activation_checkpointing=True)
    peft_model = trainer.model
    before = _snapshot(peft_model)
    trainer.train()
    after = _snapshot(peft_model)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert _optimizer_params(trainer) == {id(p) for p in peft_model.parameters() if p.requires_grad}
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
    assert any(not torch.equal(before[n], after[n]) for n in trainable if "lora_B" in n)

    export = Path(trainer.export_draft(str(tmp_path / "export")))
    assert sorted(os.listdir(export)) == [
        "config.json",
        "configuration_dflash.py",
        "dflash_run.json",
        "dflash_training.json",
        "draft_fields.py",
        "model.safetensors",
        "modeling_dflash.py",
        "modeling_dflash_encoder.py",
    ]
    plain = load_draft_strict(export).eval()
    assert type(plain) is DFlashDraftModel and plain.config.block_size == 16
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(plain.state_dict())

    merged = copy.deepcopy(peft_model).merge_and_unload().eval()
    peft_model.eval()
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        position_ids=torch.arange(12)[None],
        noise_embedding=torch.randn(1, 4, HIDDEN, generator=g),
        target_hidden=torch.randn(1, 8, plain.config.num_taps * HIDDEN, generator=g),
    )
    with torch.no_grad():
        out_plain, out_merged, out_peft = plain(**inputs), merged(**inputs), peft_model(**inputs)
    assert torch.equal(out_plain, out_merged)
    torch.testing.assert_close(out_plain, out_peft, atol=1e-5, rtol=1e-5)
    # the model under training was not merged by the export
    assert any("lora_A" in n for n, _ in peft_model.named_parameters())

    # the FSDP path: export from a gathered full state dict (rebuilt on CPU) writes the same tensors
    gathered = export_draft(plain_draft(peft_model, peft_model.state_dict()), tmp_path / "gathered")
    from_state = load_draft_strict(gathered)
    assert all(torch.equal(p, plain.state_dict()[n]) for n, p in from_state.state_dict().items())


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(projection_only=True), "projection_only=true.*init_from_pretrained"),
        (dict(lora_r=4), "lora_r > 0.*init_from_pretrained"),
        (dict(lora_r=4, projection_only=True, init_from_pretrained="x"), "exclusive"),
        (dict(lora_r=4, init_from_pretrained="x", lora_target_modules=["q_proj", "qkv"]), r"\['qkv'\].*choose from"),
        (dict(lora_r=-1), "lora_r must be >= 0"),
        (dict(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True}), "use_reentrant"),
    ],
)
def test_adaptation_args_errors(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        DFlashTrainingArguments(output_dir=str(tmp_path), **overrides)


def test_checkpointing_defaults_to_non_reentrant(tmp_path):
    args = DFlashTrainingArguments(output_dir=str(tmp_path), activation_checkpointing=True)
    assert args.activation_checkpointing_kwargs == {"use_reentrant": False}


def test_warm_start_keeps_saved_architecture(setup):
    _, _, base, _ = setup
    config = load_draft_strict(base).config
    check_warm_start(config, variant="dflash", target_layer_ids=config.target_layer_ids)
    with pytest.raises(ValueError, match="variant: dflash"):
        check_warm_start(config, variant="dflash2")
    with pytest.raises(ValueError, match="target_layer_ids"):
        check_warm_start(config, variant="dflash", target_layer_ids=[0])
    with pytest.raises(ValueError, match="mask_token_id"):
        check_warm_start(config, variant="dflash", mask_token_id=config.mask_token_id - 1)
