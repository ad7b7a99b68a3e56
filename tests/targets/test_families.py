"""Per-family tests on tiny random models built from configs in-process.

For every family: build a batch through the data pipeline (manifest -> cuts -> conversation -> processor),
run the target, and check that the decoder streams line up with what the decoder really sees:
the decoder length equals the streams length, the decoder input embeddings change under an audio
perturbation exactly at ``audio_mask`` positions (taps aligned with ids), text positions carry the embedding
of ``streams.input_ids``, and a next-token loss over ``streams.loss_mask`` is finite and covers the response.
"""

import dataclasses

import numpy as np
import pytest
import torch
import transformers as tf

from dflash_hf.data import build_train_dataloader
from dflash_hf.targets.families.registry import FAMILIES, decoder_streams, encode_batch, resolve_family
from dflash_hf.testing import tiny

H, LAYERS, HEADS, KV = 32, 2, 2, 1


def _text_cfg(tok, model_type):
    return dict(
        model_type=model_type,
        vocab_size=len(tok),
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=H // HEADS,
        max_position_embeddings=4096,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )


def _whisper_fe():
    return tf.WhisperFeatureExtractor(feature_size=16, sampling_rate=16000)


def _whisper_audio(model_type, **extra):
    return dict(model_type=model_type, num_mel_bins=16, max_source_positions=1500, **extra)


def build_qwen2_audio(tok):
    audio = _whisper_audio(
        "qwen2_audio_encoder", d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32
    )
    config = tf.Qwen2AudioConfig(
        audio_config=audio,
        text_config=_text_cfg(tok, "qwen2"),
        audio_token_index=tok.convert_tokens_to_ids(tiny.AUDIO_PAD),
    )
    processor = tf.Qwen2AudioProcessor(feature_extractor=_whisper_fe(), tokenizer=tok, chat_template=tiny.CHAT_TEMPLATE)
    return tf.Qwen2AudioForConditionalGeneration(config), processor


def save_qwen2_audio(directory):
    """A sharpened tiny Qwen2-Audio target saved with its processor (for the CLI tests); returns (model, tokenizer)."""
    tok = tiny.build_tokenizer()
    torch.manual_seed(0)
    model, processor = build_qwen2_audio(tok)
    tiny.sharpen(model.get_decoder(), seed=1)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return model, tok


def build_voxtral(tok):
    audio = _whisper_audio(
        "voxtral_encoder", hidden_size=16, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    config = tf.VoxtralConfig(
        audio_config=audio,
        text_config=_text_cfg(tok, "llama"),
        audio_token_id=tok.convert_tokens_to_ids(tiny.AUDIO_PAD),
    )
    processor = tf.VoxtralProcessor(feature_extractor=_whisper_fe(), tokenizer=tok)
    return tf.VoxtralForConditionalGeneration(config), processor


def build_audioflamingo3(tok):
    audio = _whisper_audio(
        "audioflamingo3_encoder", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    config = tf.AudioFlamingo3Config(
        audio_config=audio,
        text_config=_text_cfg(tok, "qwen2"),
        audio_token_id=tok.convert_tokens_to_ids(tiny.AUDIO_PAD),
    )
    processor = tf.AudioFlamingo3Processor(
        _whisper_fe(), tok, chat_template=tiny.CHAT_TEMPLATE, audio_token=tiny.AUDIO_PAD
    )
    return tf.AudioFlamingo3ForConditionalGeneration(config), processor


def build_glmasr(tok):
    audio = dict(
        model_type="glmasr_encoder",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_mel_bins=16,
        max_position_embeddings=1500,
    )
    config = tf.GlmAsrConfig(
        audio_config=audio,
        text_config=_text_cfg(tok, "llama"),
        audio_token_id=tok.convert_tokens_to_ids(tiny.AUDIO_PAD),
    )
    processor = tf.GlmAsrProcessor(_whisper_fe(), tok, chat_template=tiny.CHAT_TEMPLATE, audio_token=tiny.AUDIO_PAD)
    return tf.GlmAsrForConditionalGeneration(config), processor


def build_qwen3_asr(tok):
    return tiny.build_qwen3_asr_target(tok, hidden_size=H, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV)


BUILDERS = {
    "qwen3_asr": build_qwen3_asr,
    "qwen2_audio": build_qwen2_audio,
    "qwen2_audio_single_placeholder": build_qwen2_audio,
    "voxtral": build_voxtral,
    "audioflamingo3": build_audioflamingo3,
    "glmasr": build_glmasr,
}


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return tiny.synthesize_speech(tmp_path_factory.mktemp("sp"), 3, seed=4, min_dur=0.6, max_dur=1.6)


def _decoder(model):
    return model.get_decoder()


def _run(model, family, batch):
    """Forward with hooks: returns (decoder input embeddings, layer-0 output) as the decoder sees them."""
    seen = {}
    layers = _decoder(model).layers
    h1 = layers[0].register_forward_pre_hook(
        lambda m, a, kw: seen.__setitem__("emb", (kw.get("hidden_states", a[0] if a else None))), with_kwargs=True
    )
    h2 = layers[0].register_forward_hook(
        lambda m, a, out: seen.__setitem__("tap", out[0] if isinstance(out, tuple) else out)
    )
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", *family.audio_kwargs)}
    try:
        with torch.no_grad():
            out = model(**inputs)
    finally:
        h1.remove()
        h2.remove()
    return seen["emb"], seen["tap"], out.logits


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_family_streams_align_with_decoder(name, manifest):
    tok = tiny.build_tokenizer()
    torch.manual_seed(0)
    model, processor = BUILDERS[name](tok)
    model.eval()
    family = resolve_family(model.config, name)
    assert family.name == name
    loader = build_train_dataloader(
        manifest, processor, model.config, family=family, max_tokens=100_000, shuffle=False, padding_side="right"
    )
    (batch,) = list(loader)
    assert len(batch["input_ids"]) == 3
    streams = decoder_streams(family, model, batch)
    emb, tap, logits = _run(model, family, batch)
    b, s_dec = emb.shape[:2]
    assert streams.input_ids.shape == (b, s_dec) == tap.shape[:2] == logits.shape[:2]
    for t in (streams.attention_mask, streams.loss_mask, streams.audio_mask):
        assert t.shape == (b, s_dec)

    # audio positions: exactly where the decoder input changes when the audio changes
    perturbed = dict(batch)
    perturbed["input_features"] = batch["input_features"] + 1.0
    emb2, tap2, _ = _run(model, family, perturbed)
    changed = (emb2 - emb).abs().amax(-1) > 1e-6
    real = streams.attention_mask.bool()
    assert torch.equal(changed & real, streams.audio_mask & real)
    # per row, the audio frame count matches the family's token-count rule for that cut's duration
    counts = streams.audio_mask.sum(-1).tolist()
    cuts = [c for c in loader.batch_sampler.sampler.cuts[0]]
    durations = {c.id: c.duration for c in cuts}
    expected = sorted(family.audio_tokens(model.config, round(d * 16000)) for d in durations.values())
    assert sorted(counts) == expected
    # text positions carry the embedding of the streamed id; taps before the first audio frame are unchanged
    table = model.get_input_embeddings().weight
    text = real & ~streams.audio_mask
    assert torch.allclose(emb[text], table[streams.input_ids[text]], atol=1e-6)
    for row in range(b):
        first_audio = int(streams.audio_mask[row].nonzero()[0])
        before = real[row, :first_audio]
        assert torch.equal(tap[row, :first_audio][before], tap2[row, :first_audio][before])

    # loss over supervised positions: response tokens + closing end-of-turn, never audio or padding
    assert not (streams.loss_mask & (streams.audio_mask | ~real)).any()
    for row in range(b):
        sup = streams.input_ids[row][streams.loss_mask[row]].tolist()
        assert sup[-1] == tok.eos_token_id and tok.decode(sup[:-1]).split()[0] in tiny.WORDS
    target = streams.input_ids[:, 1:]
    mask = streams.loss_mask[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1][mask], target[mask])
    assert torch.isfinite(loss) and loss > 0
    if family.expansion == "model":
        assert (batch["input_ids"] == model.config.audio_token_id).sum(-1).tolist() == [1, 1, 1]
        assert s_dec > batch["input_ids"].shape[1]
        assert streams.position_ids is not None
    else:
        assert torch.equal(streams.input_ids, batch["input_ids"]) and streams.position_ids is None


def test_single_placeholder_left_padding_matches_model():
    """Left-padded model-side batch: streams equal the model's own merged attention mask."""
    tok = tiny.build_tokenizer()
    model, processor = build_qwen2_audio(tok)
    model.eval()
    family = FAMILIES["qwen2_audio_single_placeholder"]
    texts = [
        "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|><|im_end|>\n",
        "<|im_start|>user\nlonger prompt <|audio_start|><|audio_pad|><|audio_end|>x<|im_end|>\n",
    ]
    rng = np.random.default_rng(0)
    audios = [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in (30000, 9000)]
    batch = encode_batch(family, processor, model.config, texts, audios, padding_side="left")
    batch["loss_mask"] = batch["attention_mask"].bool() & (batch["input_ids"] == tok.convert_tokens_to_ids("x"))
    streams = decoder_streams(family, model, batch)
    with torch.no_grad():
        out = model.model(**{k: batch[k] for k in ("input_ids", "attention_mask", *family.audio_kwargs)})
    assert torch.equal(streams.attention_mask, out.attention_mask)
    assert (streams.attention_mask[:, -1] == 1).all() and streams.attention_mask[1, 0] == 0
    assert streams.audio_mask.sum(-1).tolist() == [family.audio_tokens(model.config, n) for n in (30000, 9000)]
    assert streams.loss_mask.sum().item() == 1 and streams.input_ids[streams.loss_mask].tolist() == [ord("x")]


def test_granite_speech_model_side_without_torchaudio():
    """Granite Speech's feature extractor needs torchaudio (absent here); check the model and the streams
    with features of the extractor's shape and the extractor's placeholder-count rule."""
    tok = tiny.build_tokenizer()
    audio_id = tok.convert_tokens_to_ids(tiny.AUDIO_PAD)
    config = tf.GraniteSpeechConfig(
        text_config=_text_cfg(tok, "granite"),
        encoder_config=dict(
            input_dim=32,
            num_layers=1,
            hidden_dim=16,
            feedforward_mult=2,
            num_heads=2,
            dim_head=8,
            output_dim=8,
            context_size=20,
            max_pos_emb=64,
        ),
        projector_config=dict(
            model_type="blip_2_qformer",
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            encoder_hidden_size=16,
        ),
        audio_token_index=audio_id,
        window_size=15,
        downsample_rate=5,
        has_lora_adapter=False,
    )
    model = tf.GraniteSpeechForConditionalGeneration(config).eval()
    family = resolve_family(config)
    assert family.name == "granite_speech"
    n = 16000
    n_tokens = family.audio_tokens(config, n)
    frames = (n // 160 + 1) // 2
    ids = tok("ab", add_special_tokens=False)["input_ids"] + [audio_id] * n_tokens + [tok.eos_token_id]
    batch = {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "input_features": torch.randn(1, frames, 32),
        "input_features_mask": torch.ones(1, n_tokens, dtype=torch.bool),
    }
    batch["loss_mask"] = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    batch["loss_mask"][0, -1] = True
    streams = decoder_streams(family, model, batch)
    emb, tap, _ = _run(model, family, batch)
    assert emb.shape[1] == streams.input_ids.shape[1] == len(ids)
    perturbed = dict(batch, input_features=batch["input_features"] + 1.0)
    emb2, _, _ = _run(model, family, perturbed)
    assert torch.equal((emb2 - emb).abs().amax(-1) > 1e-6, streams.audio_mask)


def test_resolve_family_errors_and_text():
    tok = tiny.build_tokenizer()
    text_model = tiny.build_text_target(tok, hidden_size=H, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV)
    assert resolve_family(text_model.config).name == "text"
    asr, _ = build_qwen3_asr(tok)
    assert resolve_family(asr.config).name == "qwen3_asr"
    with pytest.raises(ValueError, match="expects model_type"):
        resolve_family(asr.config, "voxtral")
    with pytest.raises(ValueError, match="unknown target family 'nope'.*qwen3_asr"):
        resolve_family(asr.config, "nope")
    unknown = tf.Qwen3ASRConfig()
    object.__setattr__(unknown, "model_type", "mystery_audio")
    with pytest.raises(ValueError, match="unsupported target model_type 'mystery_audio'.*supported families"):
        resolve_family(unknown)
    with pytest.raises(ValueError, match="text-only"):
        encode_batch(FAMILIES["text"], tok, text_model.config, ["a"], [np.zeros(10)])


@pytest.mark.compat
@pytest.mark.parametrize("name", ["qwen3_asr", "qwen2_audio_single_placeholder"])
@pytest.mark.slow  # 12 s on 2 busy cores
def test_trainer_and_decoding_follow_the_decoder_streams(name, manifest, tmp_path):
    """Model-side expansion (NeMo SALM layout): the trainer plans blocks on the expanded decoder streams
    (taps and loss mask line up), trains, and speculative decoding stays lossless with decoder positions."""
    from utils import make_args

    from dflash_hf import DFlashTrainer, speculative_generate
    from dflash_hf.data.eval_rows import prompt_inputs
    from dflash_hf.targets.frozen import FrozenTarget
    from dflash_hf.training.training_args import DFlashDataArguments

    tok = tiny.build_tokenizer()
    torch.manual_seed(0)
    model, processor = BUILDERS[name](tok)
    tiny.sharpen(model.get_decoder(), seed=1)
    args = make_args(
        tmp_path,
        mask_token_id=tok.convert_tokens_to_ids(tiny.MASK_TOKEN),
        target_family=name,
        max_steps=2,
        label_source="target_argmax",
        target_layer_ids=[0, 1],
    )
    trainer = DFlashTrainer(
        args=args,
        target=model,
        processor=processor,
        train_dataset=[str(manifest)],
        data_args=DFlashDataArguments(max_tokens=100_000, prompt="Transcribe."),
    )
    batch = next(iter(trainer.get_train_dataloader()))
    plan = trainer.objective.plan(trainer.target, batch, 0)
    taps = trainer.target.capture(batch, trainer.model.config.target_layer_ids).taps
    assert plan.loss_mask.shape == taps.shape[:2]
    assert (taps.shape[1] > batch["input_ids"].shape[1]) == (name == "qwen2_audio_single_placeholder")
    assert plan.denominator > 0 and torch.isfinite(trainer.compute_loss(trainer.model, dict(batch)))
    # Qwen3-ASR's plan carries its encoder windows from the host; the loss is the one without them
    assert (plan.target_host is not None) == (name == "qwen3_asr")
    without = dataclasses.replace(plan, target_host=None)
    assert torch.equal(
        trainer.compute_loss(trainer.model, dict(batch), plan=plan),
        trainer.compute_loss(trainer.model, dict(batch), plan=without),
    )
    trainer.train()

    loader = build_train_dataloader(
        manifest,
        processor,
        model.config,
        family=trainer.target.family,
        max_tokens=100_000,
        max_batch_size=1,
        shuffle=False,
    )
    inputs = prompt_inputs(next(iter(loader)))
    draft = trainer.model.eval()
    out = speculative_generate(draft, FrozenTarget(model, name), 12, **inputs)
    # Reference greedy decoding without a cache (transformers' generate drops the 2D mask the legacy
    # single-placeholder merge needs): one full forward per new token.
    seq = inputs["input_ids"]
    with torch.no_grad():
        while seq.shape[1] < out.sequences.shape[1]:
            step = {**inputs, "input_ids": seq, "attention_mask": torch.ones_like(seq)}
            seq = torch.cat([seq, model(**step).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out.sequences, seq) and out.sequences.shape[1] > inputs["input_ids"].shape[1]
    if name == "qwen2_audio_single_placeholder":  # dflash-eval's baseline for this row: a cached greedy loop
        from dflash_hf.generation.model_side import model_side_greedy

        assert torch.equal(model_side_greedy(FrozenTarget(model, name), 12, **inputs), out.sequences)
        # An end token stops both where it is first decoded (it is kept): make the second new token one.
        n_prompt, new = inputs["input_ids"].shape[1], out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        model.generation_config.eos_token_id = new[1]
        ft = FrozenTarget(model, name)
        stopped = speculative_generate(draft, ft, 12, **inputs).sequences
        assert torch.equal(stopped, model_side_greedy(ft, 12, **inputs))
        assert stopped.shape[1] == n_prompt + new.index(new[1]) + 1 < out.sequences.shape[1]


@pytest.mark.parametrize("name", ["qwen2_audio", "qwen2_audio_single_placeholder", "audioflamingo3", "glmasr"])
def test_batches_are_the_same_with_the_fast_whisper_extractor(name, manifest, monkeypatch):
    """The loader gives processors a Whisper extractor that skips the padding's frames: every batch tensor must be
    what the processor's own extractor gives, value and dtype."""
    from transformers import WhisperFeatureExtractor

    import dflash_hf.data.collator as collator

    tok = tiny.build_tokenizer()
    model, processor = BUILDERS[name](tok)
    assert type(processor.feature_extractor) is WhisperFeatureExtractor
    family = resolve_family(model.config, name)

    def batch():
        loader = build_train_dataloader(
            manifest, processor, model.config, family=family, max_tokens=100_000, shuffle=False, padding_side="right"
        )
        return next(iter(loader))

    fast = batch()
    monkeypatch.setattr(collator, "with_fast_features", lambda p, **_: p)
    slow = batch()
    assert set(fast) == set(slow)
    for k in slow:
        if torch.is_tensor(slow[k]):
            assert fast[k].dtype == slow[k].dtype and torch.equal(fast[k], slow[k]), k


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.slow  # 16 s on 2 busy cores
def test_fixed_shape_verify_decodes_every_audio_family_as_the_growing_cache(name, manifest):
    """`verify_cuda_graph=True` (on the CPU: the fixed-shape verify without a graph) decodes each audio LLM family
    exactly as the growing cache does: the prompt's audio positions (model-side expansion included) prefilled, then
    blocks over fixed key/value buffers."""
    from dflash_hf import DFlashConfig, DFlashDraftModel, speculative_generate
    from dflash_hf.data.eval_rows import prompt_inputs
    from dflash_hf.targets.frozen import FrozenTarget

    tok = tiny.build_tokenizer()
    torch.manual_seed(0)
    model, processor = BUILDERS[name](tok)
    tiny.sharpen(model.get_decoder(), seed=1)
    ft = FrozenTarget(model, name)
    loader = build_train_dataloader(
        manifest, processor, model.config, family=ft.family, max_tokens=100_000, max_batch_size=1, shuffle=False
    )
    inputs = prompt_inputs(next(iter(loader)))
    cfg = DFlashConfig.from_target_config(
        ft.text_config,
        mask_token_id=tok.convert_tokens_to_ids(tiny.MASK_TOKEN),
        num_hidden_layers=1,
        block_size=4,
        target_layer_ids=[0, 1],
    )
    draft = DFlashDraftModel(cfg).eval()
    eager = speculative_generate(draft, ft, 12, **inputs)
    fixed = speculative_generate(draft, ft, 12, verify_cuda_graph=True, **inputs)
    assert torch.equal(fixed.sequences, eager.sequences), name
    assert fixed.acceptance_lengths == eager.acceptance_lengths and fixed.verify_step == "fixed-shape, no graph"


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.slow  # 4 s on 2 busy cores
def test_qwen3_asr_audio_windows_found_on_the_host(manifest, layout, monkeypatch):
    """The plan computes Qwen3-ASR's encoder windows on the host (`host_facts`) and the target builds the decoder's
    embeddings itself: taps and final states bit-identical to the model's own forward, the encoder's window splits
    on the host's tensor, and fewer reads back from the device (only the encoder's `nonzero` of its valid frames
    beside the decoder's mask)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers.models.qwen3_asr import modeling_qwen3_asr

    from dflash_hf.data.packing import pack_padded_batch
    from dflash_hf.targets.families.qwen3_asr import WINDOWS_KEY
    from dflash_hf.targets.frozen import FrozenTarget

    reads = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default"}

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += str(func) in reads
            return func(*args, **(kwargs or {}))

    tok = tiny.build_tokenizer()
    model, processor = BUILDERS["qwen3_asr"](tok)
    batch = next(iter(build_train_dataloader(manifest, processor, model.config, max_tokens=100_000, shuffle=False)))
    assert batch["input_features"].shape[0] > 2
    if layout == "packed":
        batch = pack_padded_batch(batch)
    target = FrozenTarget(model)
    host = target.host_facts(batch)
    assert host is not None and host[WINDOWS_KEY].device.type == "cpu"
    assert FrozenTarget(BUILDERS["qwen2_audio"](tok)[0]).host_facts(batch) is None  # other families: none

    seen = []
    attention = modeling_qwen3_asr.Qwen3ASRAudioAttention.forward

    def recording(self, hidden_states, cu_seqlens, *args, **kwargs):
        seen.append(cu_seqlens is host[WINDOWS_KEY])
        return attention(self, hidden_states, cu_seqlens, *args, **kwargs)

    monkeypatch.setattr(modeling_qwen3_asr.Qwen3ASRAudioAttention, "forward", recording)
    with Reads() as theirs:
        ref = target.capture(batch, [0, 1], keep_final=True)
    assert seen and not any(seen)
    seen.clear()
    with Reads() as ours:
        got = target.capture(batch, [0, 1], keep_final=True, host=host)
    assert seen and all(seen)
    assert torch.equal(got.taps, ref.taps) and torch.equal(got.final_hidden, ref.final_hidden)
    n_audios = batch["input_features"].shape[0]
    assert ours.count <= theirs.count - (2 * n_audios + 2), (ours.count, theirs.count)
