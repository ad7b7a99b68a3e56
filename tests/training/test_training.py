"""Trainer behaviour: input validation, precision, checkpoints/resume, export contract and remote code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from utils import make_args, make_trainer, random_rows, tiny_text_target

from dflash_hf import DFlashConfig, DFlashDraftModel, DFlashTrainer, speculative_generate
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny


def _trainer(tmp_path, rows, model=None, tok=None, **kw):
    if model is None:
        model, tok = tiny_text_target()
    return make_trainer(tmp_path, model, tok, rows, **kw)


@pytest.mark.parametrize(
    ("mask_token_id", "message"),
    [(None, "mask_token_id is required"), (10_000, "has no row"), (256, "eos_token_id"), (257, "pad_token_id")],
)
def test_bad_mask_token_is_refused_before_the_draft_is_built(tmp_path, mask_token_id, message):
    with pytest.raises(ValueError, match=message):
        _trainer(tmp_path, random_rows(2, 250), mask_token_id=mask_token_id)


def test_mask_token_in_the_data_and_bad_taps_are_refused(tmp_path):
    model, tok = tiny_text_target()
    mask_id = tok.convert_tokens_to_ids(tiny.MASK_TOKEN)
    trainer = _trainer(tmp_path, [([5, 6, mask_id], [7, 8, 9])], model, tok)
    with pytest.raises(ValueError, match="occurs in the data"):
        trainer.train()
    with pytest.raises(ValueError, match=r"target_layer_ids \[7\] out of range"):
        _trainer(tmp_path, random_rows(2, 250), model, tok, target_layer_ids=[1, 7])
    with pytest.raises(ValueError, match="--precision bf16"):
        make_args(tmp_path, mask_token_id=mask_id, bf16=True)


@pytest.mark.slow  # 10 s on 2 busy cores
def test_bf16_precision_sets_target_and_draft_dtypes(tmp_path):
    model, tok = tiny_text_target()
    trainer = _trainer(tmp_path, random_rows(4, 250), model, tok, precision="bf16", max_steps=2)
    trainer.train()
    assert trainer.target.dtype == torch.bfloat16
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    loss = trainer.state.log_history[-1]["train_loss"]
    assert torch.isfinite(torch.tensor(loss))
    prompt = torch.randint(3, 250, (1, 6))
    am = torch.ones_like(prompt)
    out = speculative_generate(trainer.model.eval(), model, 10, input_ids=prompt, attention_mask=am)
    ref = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False)
    assert torch.equal(out.sequences, ref)


@pytest.mark.slow  # 5 s on 2 busy cores
def test_checkpoints_hold_only_the_draft_and_resume_is_exact(tmp_path):
    rows = random_rows(8, 250, seed=2)
    model, tok = tiny_text_target()
    kw = dict(max_steps=4, per_device_train_batch_size=2, save_strategy="steps", save_steps=2)
    straight = _trainer(tmp_path / "a", rows, model, tok, **kw)
    straight.train()
    ckpt = tmp_path / "a" / "out" / "checkpoint-2"
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert names == set(straight.model.state_dict())  # the draft only: no target, no embedding, no lm_head
    assert not any("embed" in n or "lm_head" in n for n in names)

    resumed = _trainer(tmp_path / "b", rows, model, tok, **kw)
    resumed.train(resume_from_checkpoint=str(ckpt))
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.compat
@pytest.mark.slow  # a fresh interpreter loads the export: ~7-9 s
def test_export_contract_and_remote_code_reload_in_a_fresh_process(tmp_path):
    model, tok = tiny_text_target()
    trainer = _trainer(tmp_path, random_rows(4, 250), model, tok, max_steps=1)
    trainer.train()
    export = trainer.export_draft(str(tmp_path / "export"))
    files = sorted(os.listdir(export))
    assert files == [
        "config.json",
        "configuration_dflash.py",
        "dflash_run.json",  # the run it is of (run_identity)
        "dflash_training.json",  # what the run used that evaluation repeats (export.training_record)
        "draft_fields.py",
        "model.safetensors",
        "modeling_dflash.py",
        "modeling_dflash_encoder.py",
    ]
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == 4
    assert cfg["dflash_config"]["mask_token_id"] == tok.convert_tokens_to_ids(tiny.MASK_TOKEN)
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 1] and cfg["num_target_layers"] == 4
    assert cfg["auto_map"]["AutoModel"] == "modeling_dflash.DFlashDraftModel"
    with safe_open(f"{export}/model.safetensors", "pt") as f:
        names = set(f.keys())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        expected |= {f"{p}self_attn.{x}_proj.weight" for x in "qkvo"} | {f"{p}self_attn.{x}_norm.weight" for x in "qk"}
        expected |= {f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    assert names == expected

    draft = DFlashDraftModel.from_pretrained(export).eval()
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        position_ids=torch.arange(14)[None],
        noise_embedding=torch.randn(1, 4, 64, generator=g),
        target_hidden=torch.randn(1, 10, 128, generator=g),
    )
    torch.save(inputs, tmp_path / "inputs.pt")
    with torch.no_grad():
        ref = draft(**inputs)
    torch.save(ref, tmp_path / "ref.pt")
    script = textwrap.dedent(
        f"""
        import sys
        # Started with -S: site-packages without .pth files, so the editable dflash_hf install is invisible.
        sys.path.append({os.path.dirname(os.path.dirname(torch.__file__))!r})
        import torch
        try:
            import dflash_hf
            raise SystemExit("dflash_hf must not be importable here")
        except ImportError:
            pass
        from transformers import AutoModel
        m = AutoModel.from_pretrained({str(export)!r}, trust_remote_code=True).eval()
        assert type(m).__name__ == "DFlashDraftModel", type(m)
        out = m(**torch.load({str(tmp_path / "inputs.pt")!r}))
        torch.testing.assert_close(out, torch.load({str(tmp_path / "ref.pt")!r}))
        print("REMOTE_OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    proc = subprocess.run(
        [sys.executable, "-S", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert "REMOTE_OK" in proc.stdout, proc.stderr[-3000:]


def test_bf16_audio_target_gets_its_features_in_bf16():
    """The collator emits float32 audio features; a bf16 target's audio encoder needs them in bf16."""
    tok = tiny.build_tokenizer()
    model, processor = tiny.build_qwen3_asr_target(tok, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)
    model.to(torch.bfloat16)
    target = FrozenTarget(model)
    conv = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Transcribe."}]}]
    text = processor.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    audio = 0.1 * torch.randn(16000, generator=torch.Generator().manual_seed(0))
    inputs = processor(text=[text], audio=[audio.numpy()], sampling_rate=16000, return_tensors="pt")
    assert inputs["input_features"].dtype == torch.float32
    feats = target.capture(dict(inputs), [1, 2])
    assert feats.taps.dtype == torch.bfloat16 and feats.taps.shape[:2] == inputs["input_ids"].shape
    cfg = DFlashConfig.from_target_config(target.text_config, mask_token_id=262, num_hidden_layers=1, block_size=4)
    draft = DFlashDraftModel(cfg).to(torch.bfloat16).eval()
    out = speculative_generate(draft, model, 6, **inputs)
    assert out.sequences.shape[1] > inputs["input_ids"].shape[1]


def test_target_loading_is_strict_unless_partial_init_is_asked_for(tmp_path):
    from safetensors.torch import load_file, save_file

    from dflash_hf.targets.frozen import load_target

    path = tiny.save_tiny_target(tmp_path / "target", kind="text", num_layers=2, hidden_size=32)
    weights = load_file(path / "model.safetensors")
    dropped = "model.layers.1.mlp.down_proj.weight"
    del weights[dropped]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 parameters.*mlp\.down_proj.*--target_strict_load false"):
        load_target(str(path))
    model = load_target(str(path), strict=False)  # intentional partial initialization
    assert model.model.layers[1].mlp.down_proj.weight.shape == (32, 64)


@pytest.mark.slow  # 10 s on 2 busy cores
def test_speech_training_resumes_mid_epoch_exactly(tmp_path):
    """lhotse loader + Trainer checkpoint: resuming at step 3 of 6 sees the same later batches and anchors."""
    from dflash_hf.training.training_args import DFlashDataArguments

    tok = tiny.build_tokenizer()
    model, processor = tiny.build_qwen3_asr_target(tok, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)
    manifest = tiny.synthesize_speech(tmp_path / "speech", 24, seed=0)

    def trainer(name: str) -> DFlashTrainer:
        args = make_args(
            tmp_path / name, mask_token_id=262, max_steps=6, save_strategy="steps", save_steps=3, learning_rate=1e-3
        )
        data_args = DFlashDataArguments(max_tokens=600, prompt="Transcribe.")
        return DFlashTrainer(
            args=args, target=model, processor=processor, data_args=data_args, train_dataset=[str(manifest)]
        )

    straight = trainer("a")
    straight.train()
    assert straight.state.global_step == 6
    checkpoint = tmp_path / "a" / "out" / "checkpoint-3"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["epoch"] < 1  # mid-epoch
    resumed = trainer("b")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 6
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_mask_token_candidates_are_embedding_rows_the_tokenizer_never_produces():
    model, tok = tiny_text_target()
    target = FrozenTarget(model)
    assert target.mask_token_candidates(tok) == []  # the tiny embedding is exactly the vocabulary
    model.resize_token_embeddings(len(tok) + 8)
    assert FrozenTarget(model).mask_token_candidates(tok, limit=3) == [len(tok), len(tok) + 1, len(tok) + 2]


def test_max_train_minutes_stops_after_the_step_that_crosses_it_and_saves(tmp_path):
    rows = random_rows(8, 250, seed=2)
    trainer = _trainer(
        tmp_path,
        rows,
        max_steps=50,
        per_device_train_batch_size=2,
        save_strategy="steps",
        save_steps=100,
        max_train_minutes=1e-9,
    )
    trainer.train()
    assert trainer.state.global_step == 1  # the first step crosses the budget; the schedule still says 50
    assert (tmp_path / "out" / "checkpoint-1" / "model.safetensors").is_file()
    for bad in (0.0, -1.0, float("inf")):  # refused by the arguments, before any target is loaded
        with pytest.raises(ValueError, match="max_train_minutes must be a positive number"):
            make_args(tmp_path / "bad", mask_token_id=5, max_train_minutes=bad)
