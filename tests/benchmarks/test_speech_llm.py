"""benchmarks/speech_llm.py: a Qwen2-Audio assembled from a tiny random Whisper and a tiny random Llama, trained a
few steps, saved, then loaded and trained on by dflash_hf unchanged (both Qwen2-Audio family rows). No downloads."""

import json

import numpy as np
import pytest
import torch
import transformers as tf
from speech_llm_steps import assembly, data, evaluation, modeling, presets, training
from utils import REPO_ROOT, doubled_name, loaded_script

from dflash_hf.targets.frozen import FrozenTarget, load_target
from dflash_hf.testing import tiny

TOKENS = dict(audio_bos=tiny.AUDIO_START, audio_token=tiny.AUDIO_PAD, audio_eos=tiny.AUDIO_END)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """Directories of a tiny Whisper (16 mel bins, 30 s input) and a tiny Llama with the tiny tokenizer."""
    root = tmp_path_factory.mktemp("parts")
    torch.manual_seed(0)
    wcfg = tf.WhisperConfig(
        vocab_size=64,
        num_mel_bins=16,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_source_positions=1500,
        max_target_positions=16,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    whisper = tf.WhisperForConditionalGeneration(wcfg)
    with torch.no_grad():  # layer norms and biases are 1 / 0 at init: make every tensor distinguishable
        for name, p in whisper.named_parameters():
            if "layer_norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p))
    whisper.save_pretrained(root / "whisper")
    tf.WhisperFeatureExtractor(feature_size=16, sampling_rate=16000).save_pretrained(root / "whisper")
    tok = tiny.build_tokenizer()
    lcfg = tf.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=2048,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    tf.LlamaForCausalLM(lcfg).save_pretrained(root / "llm")
    tok.save_pretrained(root / "llm")
    manifest = tiny.synthesize_speech(root / "speech", 3, seed=4, min_dur=0.6, max_dur=1.2)
    return root, whisper, tok, manifest


@pytest.fixture(scope="module")
def trained(parts):
    root, whisper, tok, manifest = parts
    mask_id = tok.convert_tokens_to_ids(tiny.MASK_TOKEN)
    assembled = assembly.assemble(root / "whisper", root / "llm", root / "assembled", reserved_ids=(mask_id,), **TOKENS)
    out = training.train(
        assembled,
        manifest,
        root / "trained",
        steps=6,
        batch_size=3,
        lr=3e-2,
        lora_rank=2,
        lora_lr=1e-2,
        device="cpu",
        precision="fp32",
        warmup=1,
        log_every=1,
        encoder_batch_size=3,
    )
    return assembled, out, manifest, mask_id


def test_assembled_tower_is_the_whisper_encoder(parts, trained):
    _, whisper, tok, _ = parts
    assembled, out, _, _ = trained
    report = json.loads((assembled / "assembled.json").read_text())
    assert assembly.assemble(parts[0] / "whisper", parts[0] / "llm", assembled) == assembled  # done: skipped
    assert report["unmapped_whisper_tensors"] == [] and report["mapped"] == len(whisper.model.encoder.state_dict())
    for path in (assembled, out):  # training leaves the tower untouched
        model = tf.Qwen2AudioForConditionalGeneration.from_pretrained(path)
        assert model.config.audio_token_id == tok.convert_tokens_to_ids(tiny.AUDIO_PAD)
        tower = model.model.audio_tower.state_dict()
        for name, tensor in whisper.model.encoder.state_dict().items():
            assert torch.equal(tower[name], tensor), name


def test_save_target_rewrites_the_doubled_layout(trained, tmp_path, monkeypatch, capsys):
    """The layout transformers 5.17 to 5.22 save (the language model's prefix doubled), made here whatever the installed
    transformers saves: `save_target` leaves the names vLLM's Qwen2-Audio reads, those of the fixture's targets."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from dflash_hf.serving.checkpoint_layout import DOUBLED_PREFIX

    assembled = trained[0]
    model = tf.Qwen2AudioForConditionalGeneration.from_pretrained(assembled)
    processor = tf.AutoProcessor.from_pretrained(assembled)
    real_save = type(model).save_pretrained

    def doubled_save(self, out, **kwargs):
        real_save(self, out, **kwargs)
        file = out / "model.safetensors"
        save_file({doubled_name(k): v for k, v in load_file(file).items()}, file, {"format": "pt"})

    monkeypatch.setattr(type(model), "save_pretrained", doubled_save)
    modeling.save_target(model, processor, tmp_path / "t")
    assert "weight names rewritten to the layout vLLM reads" in capsys.readouterr().out
    with safe_open(assembled / "model.safetensors", "pt") as f:
        want = set(f.keys())
    with safe_open(tmp_path / "t" / "model.safetensors", "pt") as f:
        assert set(f.keys()) == want
    assert not any(name.startswith(DOUBLED_PREFIX) for name in want)


def test_the_llm_decides_whether_vllm_can_serve_the_assembled_target(parts, trained, tmp_path):
    root, _, tok, _ = parts
    llama = json.loads((trained[0] / "assembled.json").read_text())
    assert (
        llama["text_model_type"] == "llama"
        and "always builds its text model as Qwen2ForCausalLM" in llama["vllm_serving"]
    )
    qcfg = tf.Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    tf.Qwen2ForCausalLM(qcfg).save_pretrained(tmp_path / "qwen2")
    tok.save_pretrained(tmp_path / "qwen2")
    mask_id = tok.convert_tokens_to_ids(tiny.MASK_TOKEN)
    out = assembly.assemble(
        root / "whisper", tmp_path / "qwen2", tmp_path / "assembled", reserved_ids=(mask_id,), **TOKENS
    )
    report = json.loads((out / "assembled.json").read_text())
    assert report["text_model_type"] == "qwen2" and report["llm_preset"] == presets.DEFAULT_LLM
    assert report["vllm_serving"].startswith("vLLM's Qwen2AudioForConditionalGeneration builds it as transformers does")
    model = tf.Qwen2AudioForConditionalGeneration.from_pretrained(out)
    assert model.config.text_config.model_type == "qwen2"
    assert model.model.language_model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's biases: in the checkpoint


def test_llm_presets_name_existing_tokens_and_where_they_come_from():
    preset = presets.LLM_PRESETS[presets.DEFAULT_LLM]
    assert presets.DEFAULT_LLM == "qwen2.5-coder-0.5b" and len(preset.packages) == 6 and preset.gguf.endswith(".gguf")
    assert preset.mask_token_id is None  # the placeholder row fetch-llm finds and stamps
    assert presets.LLM_PRESETS["smollm2"].audio_tokens == (presets.AUDIO_BOS, presets.AUDIO_TOKEN, presets.AUDIO_EOS)


def test_training_lowers_the_loss_and_merges_lora(trained):
    assembled, out, _, _ = trained
    recipe = json.loads((out / "recipe.json").read_text())
    losses = [p["loss"] for p in recipe["loss_curve"]]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses
    before = tf.Qwen2AudioForConditionalGeneration.from_pretrained(assembled).state_dict()
    after = tf.Qwen2AudioForConditionalGeneration.from_pretrained(out).state_dict()
    assert set(before) == set(after)  # LoRA merged: no adapter tensors saved
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any("multi_modal_projector" in k for k in changed)
    assert any("language_model" in k and "q_proj" in k for k in changed)
    assert not any("audio_tower" in k or "embed_tokens" in k for k in changed)


def test_dflash_loads_and_trains_on_it(trained, tmp_path):
    from dflash_hf.cli import train as cli_train

    _, out, manifest, mask_id = trained
    model = load_target(str(out))
    for family in ("qwen2_audio", "qwen2_audio_single_placeholder"):
        FrozenTarget(model, family=family)
        metrics = cli_train.run(
            [
                "--target_name_or_path",
                str(out),
                "--target_family",
                family,
                "--train_data",
                str(manifest),
                "--prompt",
                presets.INSTRUCTION,
                "--mask_token_id",
                str(mask_id),
                "--output_dir",
                str(tmp_path / family),
                "--max_steps",
                "1",
                "--block_size",
                "4",
                "--num_draft_layers",
                "1",
                "--use_cpu",
                "true",
                "--report_to",
                "none",
                "--label_source",
                "target_argmax",
                "--disable_tqdm",
                "true",
                "--save_strategy",
                "no",
            ]
        )
        assert np.isfinite(metrics["train_loss"]) and metrics["skipped_samples"] == 0


def test_wer_generates_and_writes_hypotheses(trained, tmp_path):
    _, out, manifest, _ = trained
    res = evaluation.wer(
        out,
        manifest,
        num_samples=2,
        batch_size=2,
        device="cpu",
        precision="bf16",
        max_new_tokens=4,
        output=tmp_path / "wer.json",
    )
    assert json.loads((tmp_path / "wer.json").read_text())["num_samples"] == 2
    assert len(res["samples"]) == 2 and all(isinstance(s["hyp"], str) for s in res["samples"])


def test_bad_inputs_name_the_flag(parts, tmp_path):
    root, _, _, manifest = parts
    with pytest.raises(ValueError, match="--audio_token"):
        assembly.assemble(root / "whisper", root / "llm", tmp_path / "x", **(TOKENS | {"audio_token": "<nope>"}))
    with pytest.raises(ValueError, match="reserved"):
        assembly.assemble(
            root / "whisper",
            root / "llm",
            tmp_path / "x",
            reserved_ids=(tiny.build_tokenizer().convert_tokens_to_ids(tiny.AUDIO_PAD),),
            **TOKENS,
        )
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"audio_filepath": "a.wav", "text": ""}) + "\n")
    with pytest.raises(ValueError, match="'text'"):
        data.read_manifest(bad)
    with pytest.raises(ValueError, match="--batch_size 4 exceeds the 3 clips"):
        training.train(root / "llm", manifest, tmp_path / "t", batch_size=4, device="cpu")


def test_an_audio_marker_the_tokenizer_splits_is_refused_before_assembly():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<|a|>": 1, "<|b|>": 2, "<|c|>": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.add_tokens(["<|a|>", "<|c|>"], special_tokens=True)
    names = {"audio_bos_token": "<|a|>", "audio_token": "<|b|>", "audio_eos_token": "<|c|>"}
    with pytest.raises(
        ValueError, match=r"--audio_token '<\|b\|>' is token 2, but .* encodes the text .* as \[0, 0, 0\]"
    ):
        assembly.special_token_ids(tok, names)
    tok.add_tokens(["<|b|>"], special_tokens=True)
    assert assembly.special_token_ids(tok, names) == {"audio_bos_token": 1, "audio_token": 2, "audio_eos_token": 3}


def test_labels_cover_the_transcript_and_end_of_turn_only(trained):
    assembled, _, manifest, _ = trained
    processor = tf.AutoProcessor.from_pretrained(assembled)
    rows = data.read_manifest(manifest)[:2]
    batch = data.encode_training_batch(processor, rows, [5, 3])
    tok = processor.tokenizer
    for i, row in enumerate(rows):
        sup = batch["labels"][i] != -100
        assert tok.decode(batch["input_ids"][i][sup]) == row["text"] + tok.eos_token
        assert int((batch["input_ids"][i] == processor.audio_token_id).sum()) == [5, 3][i]
        assert torch.equal(batch["labels"][i][sup], batch["input_ids"][i][sup])


def test_the_training_loss_is_the_full_logits_loss_at_the_supervised_positions(trained):
    """`supervised_loss` (lm_head at the supervised positions only) equals the CE of the full logits, and so do its
    gradients (fp32)."""
    assembled, _, manifest, _ = trained
    model = tf.Qwen2AudioForConditionalGeneration.from_pretrained(assembled).eval()
    processor = tf.AutoProcessor.from_pretrained(assembled)
    rows = data.read_manifest(manifest)[:2]
    cache = training.AudioCache(model, processor, 2)
    cache.fill(rows)
    frames = cache.of(rows)
    batch = data.encode_training_batch(processor, rows, [len(f) for f in frames])
    proj = model.model.multi_modal_projector.linear.weight
    proj.requires_grad_(True)
    losses, grads = [], []
    for fn in (
        lambda: modeling.lm_loss(
            modeling.forward_with_audio(model, batch["input_ids"], batch["attention_mask"], frames), batch["labels"]
        ),
        lambda: modeling.supervised_loss(model, batch["input_ids"], batch["attention_mask"], frames, batch["labels"]),
    ):
        proj.grad = None
        loss = fn()
        loss.backward()
        losses.append(loss.detach())
        grads.append(proj.grad.clone())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)


def test_max_minutes_stops_training_and_records_it(trained, tmp_path):
    assembled, _, manifest, _ = trained
    out = training.train(
        assembled,
        manifest,
        tmp_path / "t",
        steps=50,
        batch_size=2,
        lora_rank=0,
        device="cpu",
        precision="bf16",
        max_minutes=1e-6,
    )  # bf16: the device default (feature extraction stays fp32)
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["steps"] == 1 and recipe["steps_planned"] == 50 and recipe["lora_rank"] == 0


def test_a_diverged_training_saves_nothing(trained, tmp_path, monkeypatch):
    assembled, _, manifest, _ = trained
    real, calls = training.supervised_loss, []

    def diverging(*args):
        calls.append(1)
        loss = real(*args)
        return loss * float("nan") if len(calls) == 2 else loss

    monkeypatch.setattr(training, "supervised_loss", diverging)
    with pytest.raises(RuntimeError, match=r"the loss is nan at step 2 .*nothing was saved. Lower --lr"):
        training.train(assembled, manifest, tmp_path / "t", steps=4, batch_size=2, lora_rank=0, device="cpu")
    assert not (tmp_path / "t").exists()


def test_a_non_finite_gradient_stops_before_the_update(trained, tmp_path, monkeypatch):
    assembled, _, manifest, _ = trained
    real, calls = training.supervised_loss, []

    def infinite_gradient(*args):  # the loss stays finite; d sqrt(u)/du at u = 0 is infinite
        calls.append(1)
        loss = real(*args)
        return loss + torch.sqrt(loss - loss.detach()) if len(calls) == 3 else loss

    monkeypatch.setattr(training, "supervised_loss", infinite_gradient)
    with pytest.raises(RuntimeError, match=r"the gradient norm is (inf|nan) at step 3 \(loss \d+\.\d+; clips .*saved"):
        training.train(assembled, manifest, tmp_path / "t", steps=4, batch_size=2, lora_rank=0, device="cpu")
    assert not (tmp_path / "t").exists()


def test_training_path_check_catches_a_wrong_tower_path(trained, monkeypatch):
    from dflash_hf.targets.families.registry import resolve_family

    assembled, _, manifest, _ = trained
    model = tf.Qwen2AudioForConditionalGeneration.from_pretrained(assembled).eval()
    processor = tf.AutoProcessor.from_pretrained(assembled)
    rows = data.read_manifest(manifest)[:2]
    cache = training.AudioCache(model, processor, 2)
    family = resolve_family(model.config, "qwen2_audio")
    training.check_cached_forward(model, processor, family, rows, cache, presets.INSTRUCTION)  # the real path passes
    right = modeling.encode_audio
    monkeypatch.setattr(training, "encode_audio", lambda *a: [f * 1.5 for f in right(*a)])
    with pytest.raises(RuntimeError, match="differs from the model's forward"):
        training.check_cached_forward(model, processor, family, rows, cache, presets.INSTRUCTION)


def test_time_budget_is_replanned_from_the_rate_after_the_first_steps(monkeypatch):
    # the first 20 steps took 40 s (warm-up, shared GPU); since then 50 steps took 25 s: 0.5 s a step
    monkeypatch.setattr(training.time, "time", lambda: 1000.0)
    first = training.planned_horizon(20, 2000, elapsed=40.0, budget=210.0, probe=None)
    assert first == 20 + int(170 / 2.0)  # from the first steps' 2 s a step
    later = training.planned_horizon(70, 2000, elapsed=65.0, budget=210.0, probe=(20, 1000.0 - 25.0))
    assert later == 70 + int(145 / 0.5)  # from the measured rate: the run is not ended at half its budget
    assert training.planned_horizon(70, 100, elapsed=65.0, budget=210.0, probe=(20, 975.0)) == 100  # never past --steps
    assert training.planned_horizon(70, 2000, elapsed=300.0, budget=210.0, probe=(20, 975.0)) == 71


def test_the_script_parses_the_documented_commands():
    """benchmarks/speech_llm.py, a thin command line over speech_llm_steps/: README's four commands parse."""
    with loaded_script(REPO_ROOT / "benchmarks" / "speech_llm.py") as script:
        parser = script.make_parser()
        commands = [
            ["fetch-llm", "--cache", "C"],
            ["assemble", "--whisper", "W", "--llm", "C/qwen2.5-coder-0.5b/hf", "--out", "A"],
            ["train", "--model", "A", "--train", "train.json", "--out", "S", "--steps", "2000", "--max_minutes", "5"],
            ["wer", "--model", "S", "--manifest", "eval.json", "--num_samples", "200"],
        ]
        assert [parser.parse_args(c).command for c in commands] == ["fetch-llm", "assemble", "train", "wer"]
        assert parser.parse_args(commands[0]).name == presets.DEFAULT_LLM
