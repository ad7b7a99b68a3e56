"""Tiny random targets, an in-process byte-level tokenizer and synthetic speech.

Everything here is built in-process from configs (no downloads), so tests and the demo run offline.

It ships inside the package, not under ``tests/``, because ``dflash-demo`` (:mod:`dflash_hf.cli.demo`) needs it on an
installed package without the repository: the demo trains against :func:`build_qwen3_asr_target` with
:func:`build_tokenizer`'s mask token on :func:`synthesize_speech` utterances. The other builders (text and Whisper
targets, :func:`save_tiny_target`, :func:`sharpen`) serve only the tests; they stay beside the shared tokenizer,
special tokens and config helpers so that tests and demo build their targets one way.

- :func:`build_tokenizer`: byte-level BPE (256 byte tokens, no merges) plus Qwen-style special tokens and a
  Qwen-style chat template that renders audio content items as ``<|audio_start|><|audio_pad|><|audio_end|>``
  (the single ``<|audio_pad|>`` is expanded processor-side, exactly as the real Qwen3-ASR processor does).
- :func:`build_qwen3_asr_target`: a tiny random ``Qwen3ASRForConditionalGeneration`` and its real
  ``Qwen3ASRProcessor`` (tiny feature extractor: few mel bins, 16 kHz); its config carries the fields vLLM reads
  beyond transformers' (``targets.families.qwen3_asr.add_vllm_serving_fields``), so a saved one loads in vLLM.
- :func:`build_text_target`: a tiny random ``Qwen3ForCausalLM``.
- :func:`build_whisper_target`: a tiny random ``WhisperForConditionalGeneration`` with a real
  ``WhisperProcessor`` (byte-level Whisper tokenizer with Whisper's special-token layout, 4 s feature chunks).
- :func:`synthesize_speech`: tone sequences whose pitch pattern encodes the transcript words, written with
  ``soundfile``, plus a NeMo JSON-lines manifest.
- :func:`save_tiny_target`: ``save_pretrained`` a tiny target so it loads offline with ``from_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen3ASRConfig,
    Qwen3ASRFeatureExtractor,
    Qwen3ASRForConditionalGeneration,
    Qwen3ASRProcessor,
    Qwen3Config,
    Qwen3ForCausalLM,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
    WhisperTokenizer,
)
from transformers.models.whisper.tokenization_whisper import LANGUAGES

from dflash_hf.targets.families.qwen3_asr import add_vllm_serving_fields

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
AUDIO_START = "<|audio_start|>"
AUDIO_END = "<|audio_end|>"
AUDIO_PAD = "<|audio_pad|>"
MASK_TOKEN = "<|dflash_mask|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, AUDIO_START, AUDIO_END, AUDIO_PAD, MASK_TOKEN)

SAMPLING_RATE = 16000
NUM_MEL_BINS = 16

# Qwen-style template. Message content is either a string or a list of items; an audio item (any item with
# "type": "audio") renders as the audio placeholder that the processor expands to one token per encoder frame.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'audio' -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif item['type'] == 'text' -%}"
    "{{- item['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if not (loop.last and continue_final_message) -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Words of the synthetic transcripts; word i is a tone at WORD_FREQS[i].
WORDS = ("yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go", "one", "two")
WORD_FREQS = tuple(220.0 * 2 ** (i / 4) for i in range(len(WORDS)))


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: 256 byte tokens (ids 0-255, no merges) then the special tokens (ids 256-262).

    ``<|endoftext|>`` is the pad token, ``<|im_end|>`` the eos (end of turn), ``<|audio_pad|>`` the audio
    placeholder; ``<|dflash_mask|>`` (:data:`MASK_TOKEN`) is reserved and never produced by the template.
    """
    byte_to_unicode = _bytes_to_unicode()
    vocab = {byte_to_unicode[b]: b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        extra_special_tokens={
            "audio_token": AUDIO_PAD,
            "audio_bos_token": AUDIO_START,
            "audio_eos_token": AUDIO_END,
        },
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=8192,
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [IM_START, MASK_TOKEN]}, replace_extra_special_tokens=False
    )
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if sorted(ids) != list(range(256, 256 + len(SPECIAL_TOKENS))):
        raise RuntimeError(f"unexpected special token ids {dict(zip(SPECIAL_TOKENS, ids))}")
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable unicode character map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _text_config(tokenizer, hidden_size, num_layers, num_heads, num_kv_heads) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def build_qwen3_asr_feature_extractor() -> Qwen3ASRFeatureExtractor:
    """Tiny Qwen3-ASR feature extractor: 16 mel bins at 16 kHz, 10 ms hop (real: 128 bins)."""
    return Qwen3ASRFeatureExtractor(feature_size=NUM_MEL_BINS, sampling_rate=SAMPLING_RATE)


def build_qwen3_asr_target(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    audio_conv_channels: int = 8,
    seed: int = 0,
) -> tuple[Qwen3ASRForConditionalGeneration, Qwen3ASRProcessor]:
    """Tiny random Qwen3-ASR (2-layer audio encoder whose convolutions have ``audio_conv_channels`` channels,
    ``num_layers`` Qwen3 decoder layers), float32, eval."""
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    audio_config = dict(
        model_type="qwen3_asr_encoder",
        num_mel_bins=NUM_MEL_BINS,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        d_model=32,
        output_dim=hidden_size,
        n_window=50,
        n_window_infer=100,
        downsample_hidden_size=audio_conv_channels,
        max_position_embeddings=13,
        # 0.02 (the default) makes the tiny encoder's output almost independent of its input (positional
        # embeddings dominate after ln_post); 0.2 keeps the audio informative
        initializer_range=0.2,
    )
    config = Qwen3ASRConfig(
        audio_config=audio_config,
        text_config=dict(
            model_type="qwen3", **_text_config(tokenizer, hidden_size, num_layers, num_heads, num_kv_heads)
        ),
        audio_token_id=tokenizer.convert_tokens_to_ids(AUDIO_PAD),
        timestamp_token_id=tokenizer.convert_tokens_to_ids(MASK_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    add_vllm_serving_fields(config)  # what vLLM's Qwen3-ASR reads beyond transformers' config: saved, it serves
    torch.manual_seed(seed)
    model = Qwen3ASRForConditionalGeneration(config).to(torch.float32).eval()
    _set_generation_defaults(model, tokenizer)
    processor = Qwen3ASRProcessor(
        feature_extractor=build_qwen3_asr_feature_extractor(),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    return model, processor


def build_text_target(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
) -> Qwen3ForCausalLM:
    """Tiny random ``Qwen3ForCausalLM`` over the byte-level tokenizer's vocabulary, float32, eval."""
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    config = Qwen3Config(**_text_config(tokenizer, hidden_size, num_layers, num_heads, num_kv_heads))
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    _set_generation_defaults(model, tokenizer)
    return model


def _set_generation_defaults(model, tokenizer) -> None:
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    model.generation_config.do_sample = False


# Whisper's decoder vocabulary after the text tokens, in Whisper's order: end of text, start of transcript, one
# token per language, the task tokens, then no-timestamps and the timestamp tokens <|0.00|>, <|0.02|>, ...
WHISPER_EOT = "<|endoftext|>"
WHISPER_SOT = "<|startoftranscript|>"
WHISPER_NO_TIMESTAMPS = "<|notimestamps|>"
WHISPER_TASK_TOKENS = ("<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>")
WHISPER_NUM_TIMESTAMPS = 16
WHISPER_CHUNK_SECONDS = 4  # real Whisper: 30 s (3000 mel frames, 1500 encoder positions)


def build_whisper_tokenizer() -> WhisperTokenizer:
    """Byte-level ``WhisperTokenizer``: 256 byte tokens (ids 0-255, no merges), then Whisper's special tokens in
    Whisper's order (:data:`WHISPER_EOT` = 256, :data:`WHISPER_SOT` = 257, the 99+ language tokens, the task tokens,
    ``<|notimestamps|>``) and :data:`WHISPER_NUM_TIMESTAMPS` timestamp tokens (never produced by text encoding:
    the natural ``mask_token_id`` choices when decoding without timestamps)."""
    byte_to_unicode = _bytes_to_unicode()
    vocab = {byte_to_unicode[b]: b for b in range(256)}
    languages = tuple(f"<|{code}|>" for code in LANGUAGES)
    timestamps = tuple(f"<|{0.02 * i:.2f}|>" for i in range(WHISPER_NUM_TIMESTAMPS))
    specials = (WHISPER_EOT, WHISPER_SOT, *languages, *WHISPER_TASK_TOKENS, WHISPER_NO_TIMESTAMPS, *timestamps)
    tokenizer = WhisperTokenizer(vocab=vocab, merges=[], pad_token=WHISPER_EOT, model_max_length=448)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [t for t in specials if t != WHISPER_EOT]}, replace_extra_special_tokens=False
    )
    ids = tokenizer.convert_tokens_to_ids(list(specials))
    if ids != list(range(256, 256 + len(specials))):
        raise RuntimeError(f"unexpected Whisper special token ids: {ids[:4]}...")
    tokenizer.set_prefix_tokens(language="en", task="transcribe", predict_timestamps=False)
    return tokenizer


def build_whisper_target(
    tokenizer: WhisperTokenizer | None = None,
    *,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    seed: int = 0,
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor]:
    """Tiny random multilingual ``WhisperForConditionalGeneration`` (2-layer encoder, ``num_layers`` decoder
    layers, :data:`WHISPER_CHUNK_SECONDS` s audio windows) and its ``WhisperProcessor``, float32, eval. The
    generation config is the one real Whisper checkpoints ship (language and task tokens, no-timestamps token,
    suppressed and begin-suppressed tokens), so ``generate`` applies Whisper's own logits processors."""
    tokenizer = tokenizer if tokenizer is not None else build_whisper_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    eot, sot, no_ts = ids(WHISPER_EOT), ids(WHISPER_SOT), ids(WHISPER_NO_TIMESTAMPS)
    frames = WHISPER_CHUNK_SECONDS * SAMPLING_RATE // 160
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=NUM_MEL_BINS,
        d_model=hidden_size,
        encoder_layers=2,
        encoder_attention_heads=num_heads,
        encoder_ffn_dim=2 * hidden_size,
        decoder_layers=num_layers,
        decoder_attention_heads=num_heads,
        decoder_ffn_dim=2 * hidden_size,
        max_source_positions=frames // 2,
        max_target_positions=448,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        begin_suppress_tokens=[ids("Ġ"), eot],
        suppress_tokens=[],
        init_std=0.2,
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).to(torch.float32).eval()
    gen = model.generation_config
    gen.decoder_start_token_id, gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = sot, eot, eot, eot
    gen.is_multilingual = True
    gen.lang_to_id = {f"<|{code}|>": ids(f"<|{code}|>") for code in LANGUAGES}
    gen.task_to_id = {"translate": ids("<|translate|>"), "transcribe": ids("<|transcribe|>")}
    gen.no_timestamps_token_id = no_ts
    gen.language, gen.task = "en", "transcribe"  # no language detection: a random model guesses at random
    # Whisper suppresses some punctuation and the special tokens that may not appear in a transcript
    gen.suppress_tokens = [ids("#"), ids("("), ids(")"), *ids(list(WHISPER_TASK_TOKENS))]
    gen.begin_suppress_tokens = [ids("Ġ"), eot]
    gen.max_length = 448
    gen.do_sample = False
    feature_extractor = WhisperFeatureExtractor(
        feature_size=NUM_MEL_BINS, sampling_rate=SAMPLING_RATE, chunk_length=WHISPER_CHUNK_SECONDS
    )
    return model, WhisperProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer)


def save_tiny_target(out_dir: str | Path, kind: str = "qwen3_asr", **kw) -> Path:
    """Build a tiny target (``kind``: ``"qwen3_asr"``, ``"whisper"`` or ``"text"``; ``kw`` go to the builder) and
    ``save_pretrained`` the model with its processor (or tokenizer) into ``out_dir``; returns ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if kind == "qwen3_asr":
        model, processor = build_qwen3_asr_target(**kw)
        processor.save_pretrained(out_dir)
    elif kind == "whisper":
        model, processor = build_whisper_target(**kw)
        processor.save_pretrained(out_dir)
    elif kind == "text":
        tokenizer = kw.pop("tokenizer", None) or build_tokenizer()
        model = build_text_target(tokenizer, **kw)
        tokenizer.save_pretrained(out_dir)
    else:
        raise ValueError(f"save_tiny_target: unknown kind={kind!r}; use 'qwen3_asr', 'whisper' or 'text'")
    model.save_pretrained(out_dir)
    return out_dir


def synthesize_speech(
    out_dir: str | Path,
    num_utterances: int = 8,
    *,
    seed: int = 0,
    fmt: str = "wav",
    min_dur: float = 0.6,
    max_dur: float = 2.0,
    sampling_rate: int = SAMPLING_RATE,
    manifest_name: str = "manifest.jsonl",
    word_gap: float = 0.05,
) -> Path:
    """Write ``num_utterances`` synthetic utterances and a NeMo manifest; return the manifest path.

    Each utterance is a sequence of 0.2 s tones (with ``word_gap`` s of silence before each), one per transcript word,
    whose pitch identifies the word (:data:`WORDS` / :data:`WORD_FREQS`); the duration is drawn uniformly
    in ``[min_dur, max_dur]`` and the word count is what fits. Audio goes to ``out_dir/audio/utt-XXXX.<fmt>``
    (``fmt`` ``"wav"`` or ``"flac"``); manifest lines hold ``audio_filepath`` (relative to the manifest),
    ``duration``, ``text``.
    """
    if fmt not in ("wav", "flac"):
        raise ValueError(f"synthesize_speech: fmt must be 'wav' or 'flac', got {fmt!r}")
    if word_gap <= 0 or not round(0.2 + 2 * word_gap, 6) <= min_dur <= max_dur:
        raise ValueError(
            f"synthesize_speech: need word_gap > 0 and 0.2 + 2 * word_gap <= min_dur <= max_dur (a word between two "
            f"gaps fits), got word_gap={word_gap}, min_dur={min_dur}, max_dur={max_dur}"
        )
    out_dir = Path(out_dir)
    (out_dir / "audio").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    word_len, gap = 0.2, word_gap
    lines = []
    for i in range(num_utterances):
        duration = float(np.round(rng.uniform(min_dur, max_dur), 2))
        n_words = max(1, int((duration - gap) // (word_len + gap)))
        word_ids = rng.integers(0, len(WORDS), size=n_words)
        num_samples = int(round(duration * sampling_rate))
        audio = np.zeros(num_samples, dtype=np.float32)
        t = np.arange(int(word_len * sampling_rate)) / sampling_rate
        envelope = np.hanning(len(t)).astype(np.float32)
        for k, w in enumerate(word_ids):
            start = int((gap + k * (word_len + gap)) * sampling_rate)
            tone = 0.5 * envelope * np.sin(2 * np.pi * WORD_FREQS[w] * t).astype(np.float32)
            audio[start : start + len(tone)] = tone[: max(0, num_samples - start)]
        audio += 0.003 * rng.standard_normal(num_samples).astype(np.float32)
        rel = f"audio/utt-{i:04d}.{fmt}"
        sf.write(out_dir / rel, audio, sampling_rate, subtype="PCM_16")
        lines.append(
            {
                "audio_filepath": rel,
                "duration": num_samples / sampling_rate,
                "text": " ".join(WORDS[w] for w in word_ids),
            }
        )
    manifest = out_dir / manifest_name
    with open(manifest, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    return manifest


def sharpen(model, seed: int = 0, embed_std: float = 0.3, layer_std: float = 0.15):
    """Re-initialize the 2-D weights of a tiny random target with larger values so its greedy continuations
    are varied (a default-init tiny model repeats one token, which makes decoding tests and demos trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = embed_std if ("embed" in name or "lm_head" in name) else layer_std
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model
