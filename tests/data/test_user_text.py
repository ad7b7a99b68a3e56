"""User text is text, for every family's template: a transcript, context or system prompt holding a control token's
string (turn markers, end of text, the audio placeholder, the mask token, Whisper's task and timestamp tokens) or a
lone surrogate is a bad sample naming its row, field and token (raised, or skipped and counted); the mask token id is
refused where the template, the processor or a sample uses it."""

import json

import numpy as np
import pytest
import soundfile as sf

from dflash_hf.data import BadSampleError, BadSamples, ConversationRenderer, DataSource, build_train_dataloader
from dflash_hf.data.sample_checks import SampleValidator
from dflash_hf.data.sources import open_source
from dflash_hf.targets.families.registry import resolve_family
from dflash_hf.testing import tiny

QWEN_CONTROL = ["<|im_end|>", "<|im_start|>assistant", "<|endoftext|>", "<|audio_pad|>", "<|dflash_mask|>"]


def _manifest(root, texts, extra=None) -> str:
    sf.write(root / "a.wav", np.full(32000, 0.1, np.float32), 16000)  # 2 s: room for the longest text
    rows = [{"audio_filepath": "a.wav", "duration": 2.0, "text": t, **(extra or {})} for t in texts]
    (root / "m.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(root / "m.json")


def _validate(path_or_source, processor, config, skip=False, family=None, **kw):
    fam = resolve_family(config, family)
    bad = BadSamples(skip=skip)
    validator = SampleValidator(ConversationRenderer(processor, fam), fam, config, max_tokens=None, bad=bad, **kw)
    return [c for c in map(validator, open_source(path_or_source, bad)) if c is not None], bad


@pytest.mark.parametrize("control", QWEN_CONTROL)
def test_chat_template_family_transcript_with_a_control_token_is_a_bad_sample(tmp_path, asr_target, control):
    model, processor = asr_target
    path = _manifest(tmp_path, ["fine words", f"before {control} after"])
    with pytest.raises(BadSampleError, match=r"line 2\): field 'text': holds the tokenizer's control token '<\|"):
        _validate(path, processor, model.config)
    kept, bad = _validate(path, processor, model.config, skip=True)
    assert [c.supervisions[0].text for c in kept] == ["fine words"] and bad.num_skipped == 1


def test_context_and_system_prompt_fields_are_checked_too(tmp_path, asr_target):
    model, processor = asr_target
    for key in ("context", "system_prompt"):
        path = _manifest(tmp_path, ["ok"], {key: "say <|im_end|><|im_start|>system"})
        with pytest.raises(BadSampleError, match=f"field '{key}': holds the tokenizer's control token"):
            _validate(path, processor, model.config)


def test_lone_surrogate_is_a_bad_sample(tmp_path, asr_target):
    model, processor = asr_target
    path = tmp_path / "m.json"
    sf.write(tmp_path / "a.wav", np.full(8000, 0.1, np.float32), 16000)
    path.write_text('{"audio_filepath": "a.wav", "duration": 0.5, "text": "bad \\ud800 text"}\n')
    with pytest.raises(BadSampleError, match=r"field 'text': holds a lone UTF-16 surrogate '\\ud800' at character 4"):
        _validate(str(path), processor, model.config)


def test_plain_markup_and_spaced_tokens_stay_text(tmp_path, asr_target):
    model, processor = asr_target
    texts = ["a < b > c", "<b>bold</b>", "<| im_end |>", "[laughter]"]
    kept, _ = _validate(_manifest(tmp_path, texts), processor, model.config)
    assert len(kept) == len(texts)


def test_text_family_template(tmp_path):
    datasets = pytest.importorskip("datasets")
    tok = tiny.build_tokenizer()
    model = tiny.build_text_target(tok, hidden_size=32, num_layers=2)
    ds = datasets.Dataset.from_dict({"text": ["ok", "x<|im_end|>y"], "context": ["q", "q"]})
    source = DataSource(hf_dataset=ds, audio_column=None)
    with pytest.raises(BadSampleError, match=r"row 1\): field 'text'.*'<\|im_end\|>'"):
        _validate(source, tok, model.config)


def test_whisper_decoder_prompt_tokens_in_a_transcript(tmp_path):
    model, processor = tiny.build_whisper_target(hidden_size=32, num_heads=2)
    for control in ("<|endoftext|>", "<|en|>", "<|transcribe|>", "<|0.00|>"):
        path = _manifest(tmp_path, ["fine", f"x {control}"])
        with pytest.raises(BadSampleError, match=r"line 2\): field 'text': holds the tokenizer's control token"):
            _validate(path, processor, model.config)


def test_moonshine_tokens_in_a_transcript(tmp_path):
    from transformers import (
        MoonshineConfig,
        MoonshineForConditionalGeneration,
        Wav2Vec2FeatureExtractor,
        Wav2Vec2Processor,
    )

    tok = tiny.build_tokenizer()
    tok.bos_token = "<|im_start|>"
    config = MoonshineConfig(
        vocab_size=len(tok) + 8,
        hidden_size=32,
        intermediate_size=64,
        encoder_num_hidden_layers=1,
        decoder_num_hidden_layers=1,
        encoder_num_attention_heads=2,
        decoder_num_attention_heads=2,
        decoder_start_token_id=tok.bos_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = MoonshineForConditionalGeneration(config)
    processor = Wav2Vec2Processor(feature_extractor=Wav2Vec2FeatureExtractor(feature_size=1), tokenizer=tok)
    path = _manifest(tmp_path, ["fine", "x <|im_start|> y"])
    with pytest.raises(BadSampleError, match=r"line 2\): field 'text'.*'<\|im_start\|>'"):
        _validate(path, processor, model.config)


@pytest.mark.parametrize("token", ["<|im_start|>", "<|audio_pad|>", "<|audio_start|>", "<|im_end|>"])
def test_mask_token_id_the_template_emits_is_refused_before_training(tmp_path, asr_target, token):
    model, processor = asr_target
    mask = processor.tokenizer.convert_tokens_to_ids(token)
    path = _manifest(tmp_path, ["fine"])
    with pytest.raises(ValueError, match=f"mask_token_id={mask} .*{token.replace('|', '.')}.*Fix: set --mask_token_id"):
        build_train_dataloader(path, processor, model.config, max_tokens=400, mask_token_id=mask)


def test_mask_token_id_a_sample_uses_is_refused_naming_the_sample(tmp_path, asr_target):
    model, processor = asr_target
    mask = processor.tokenizer.convert_tokens_to_ids("z")  # the byte 'z': not in the template, in row 2
    path = _manifest(tmp_path, ["fine", "a lazy row"])
    with pytest.raises(
        ValueError, match=r"mask_token_id=\d+ .*occurs in the tokens of sample 'm-00000001' \(.*line 2\)"
    ):
        build_train_dataloader(path, processor, model.config, max_tokens=400, mask_token_id=mask)
    free = processor.tokenizer.convert_tokens_to_ids("<|dflash_mask|>")
    assert build_train_dataloader(path, processor, model.config, max_tokens=400, mask_token_id=free) is not None


def test_dflash_eval_text_prompt_with_a_lone_surrogate_names_the_line_and_field(tmp_path):
    from dflash_hf.data.text_prompts import text_prompts

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "fine"}\n{"messages": [{"role": "user", "content": "a \\udc00"}]}\n')
    prompts = text_prompts(str(data), tiny.build_tokenizer())
    assert next(prompts)["input_ids"].shape[0] == 1
    with pytest.raises(ValueError, match=r"line 2: field 'messages\[0\].content' holds a lone UTF-16 surrogate"):
        next(prompts)
