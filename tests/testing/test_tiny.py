import json

import numpy as np
import pytest
import soundfile as sf
import torch
from transformers import AutoModelForCausalLM, AutoProcessor, AutoTokenizer, Qwen3ASRForConditionalGeneration

from dflash_hf.testing import tiny


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture(scope="module")
def asr(tokenizer):
    return tiny.build_qwen3_asr_target(tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)


def _conversation():
    return [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Transcribe."}]},
        {"role": "assistant", "content": "yes no"},
    ]


def test_tokenizer_bytes_specials_and_template(tokenizer):
    assert len(tokenizer) == 263
    assert tokenizer("aé").input_ids == [ord("a"), 0xC3, 0xA9]  # utf-8 bytes, one token each
    assert tokenizer.decode(tokenizer("héllo wörld").input_ids) == "héllo wörld"
    specials = [tokenizer.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS]
    assert sorted(specials) == list(range(256, 263))
    assert tokenizer.pad_token == tiny.PAD_TOKEN and tokenizer.eos_token == tiny.IM_END
    assert tokenizer.audio_token == tiny.AUDIO_PAD
    # special tokens are never split into bytes
    assert tokenizer("<|im_start|>x").input_ids == [tokenizer.convert_tokens_to_ids(tiny.IM_START), ord("x")]
    text = tokenizer.apply_chat_template([{"role": "system", "content": "S"}] + _conversation(), tokenize=False)
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n"
        "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>Transcribe.<|im_end|>\n"
        "<|im_start|>assistant\nyes no<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(_conversation()[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("Transcribe.<|im_end|>\n<|im_start|>assistant\n")
    assert tiny.MASK_TOKEN not in text


def test_processor_expands_audio_to_encoder_frames(asr):
    model, processor = asr
    text = processor.apply_chat_template(_conversation(), tokenize=False)
    rng = np.random.default_rng(0)
    audio = [0.1 * rng.standard_normal(n).astype(np.float32) for n in (23000, 9000, 41000)]
    batch = processor(text=[text] * 3, audio=audio, sampling_rate=16000)
    n_pad = (batch["input_ids"] == model.config.audio_token_id).sum(-1)
    with torch.no_grad():
        frames = model.get_audio_features(batch["input_features"], batch["input_features_mask"]).pooler_output
    assert frames.shape == (int(n_pad.sum()), model.config.text_config.hidden_size)
    # per-utterance counts differ with the audio length and follow the encoder's length rule
    assert n_pad.tolist()[0] > n_pad.tolist()[1] and n_pad.tolist()[2] > n_pad.tolist()[0]
    assert n_pad.tolist() == processor._get_audio_token_length(batch["input_features_mask"].sum(-1)).tolist()
    # left padding, as the real processor does
    assert batch["attention_mask"][1, 0] == 0 and batch["attention_mask"][1, -1] == 1
    with torch.no_grad():
        out = model(**batch)
    assert out.logits.shape == (3, batch["input_ids"].shape[1], 263)
    assert torch.isfinite(out.logits).all()


def test_text_target_forward(tokenizer):
    model = tiny.build_text_target(tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    ids = tokenizer("hello", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 5, len(tokenizer))
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id


def test_seed_changes_weights(tokenizer):
    a = tiny.build_text_target(tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=0)
    b = tiny.build_text_target(tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=0)
    c = tiny.build_text_target(tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=1)
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


@pytest.mark.compat
def test_save_load_round_trip_same_logits(tmp_path):
    kw = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=3)
    out = tiny.save_tiny_target(tmp_path / "asr", "qwen3_asr", **kw)
    model, processor = tiny.build_qwen3_asr_target(**kw)
    model2 = Qwen3ASRForConditionalGeneration.from_pretrained(out).eval()
    processor2 = AutoProcessor.from_pretrained(out)
    assert type(processor2) is type(processor)
    text = processor2.apply_chat_template(_conversation(), tokenize=False)
    audio = [0.1 * np.random.default_rng(1).standard_normal(20000).astype(np.float32)]
    b1 = processor(text=[text], audio=audio, sampling_rate=16000)
    b2 = processor2(text=[text], audio=audio, sampling_rate=16000)
    assert b1.keys() == b2.keys() and all(torch.equal(b1[k], b2[k]) for k in b1)
    with torch.no_grad():
        assert torch.equal(model(**b1).logits, model2(**b2).logits)

    out = tiny.save_tiny_target(tmp_path / "text", "text", **kw)
    text_model = tiny.build_text_target(**kw)
    text_model2 = AutoModelForCausalLM.from_pretrained(out).eval()
    tok2 = AutoTokenizer.from_pretrained(out)
    ids = tok2("yes no", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(text_model(input_ids=ids).logits, text_model2(input_ids=ids).logits)
    assert tok2.convert_tokens_to_ids(tiny.MASK_TOKEN) == 262

    with pytest.raises(ValueError, match="unknown kind"):
        tiny.save_tiny_target(tmp_path / "x", "nope")


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_synthesize_speech(tmp_path, fmt):
    manifest = tiny.synthesize_speech(tmp_path, num_utterances=4, seed=1, fmt=fmt, min_dur=0.5, max_dur=1.5)
    lines = [json.loads(x) for x in manifest.read_text().splitlines()]
    assert len(lines) == 4
    for line in lines:
        path = manifest.parent / line["audio_filepath"]
        assert not line["audio_filepath"].startswith("/") and path.suffix == "." + fmt
        audio, sr = sf.read(path)
        assert sr == 16000 and audio.ndim == 1
        assert abs(len(audio) / sr - line["duration"]) < 1e-6
        assert 0.5 <= line["duration"] <= 1.5
        words = line["text"].split()
        assert words and set(words) <= set(tiny.WORDS)
        # the first word's tone dominates its 0.2 s segment
        seg = audio[int(0.05 * sr) : int(0.25 * sr)]
        freq = np.argmax(np.abs(np.fft.rfft(seg))) * sr / len(seg)
        assert abs(freq - tiny.WORD_FREQS[tiny.WORDS.index(words[0])]) < 10
    again = tiny.synthesize_speech(tmp_path / "b", 4, seed=1, fmt=fmt, min_dur=0.5, max_dur=1.5)
    assert [json.loads(x)["text"] for x in again.read_text().splitlines()] == [x["text"] for x in lines]
