"""Whisper (encoder-decoder) targets: training from manifests, decoder taps, lossless decoding, custom_generate."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from utils import TINY_WHISPER_MASK as MASK
from utils import scripted_draft, tiny_qwen3_asr_prompt, tiny_text_target, tiny_whisper, whisper_draft, whisper_features

from dflash_hf import DFlashConfig, DFlashDraftModel, speculative_generate
from dflash_hf.data import ConversationConfig, build_train_dataloader
from dflash_hf.data.bad_samples import BadSampleError
from dflash_hf.generation import target_generate
from dflash_hf.generation.speculative import dflash_custom_generate
from dflash_hf.objective.labels.target_argmax import target_argmax_labels
from dflash_hf.targets.families.whisper_features import with_whole_window
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny

BLOCK = 4


@pytest.fixture(scope="module")
def whisper():
    return tiny_whisper()


def _manifest(tmp_path, rows_extra=None):
    manifest = tiny.synthesize_speech(tmp_path / "speech", 6, seed=0)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    rows[0]["lang"] = "de"
    for i, extra in (rows_extra or {}).items():
        rows[i].update(extra)
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


def test_decoder_prompt_is_context_and_the_transcript_and_end_token_are_supervised(whisper, tmp_path):
    model, processor = whisper
    tok = processor.tokenizer
    loader = build_train_dataloader(
        str(_manifest(tmp_path)), processor, model.config, max_tokens=400, shuffle=False, compact_features=True
    )
    target = FrozenTarget(model)
    assert target.family.name == "whisper"
    languages = set()
    for batch, whole in zip(
        loader, build_train_dataloader(str(_manifest(tmp_path)), processor, model.config, max_tokens=400, shuffle=False)
    ):
        # compact features: the frames that hold audio; the target rebuilds the window, taps bit-identical
        assert batch["input_features_compact"].shape[1] == tiny.NUM_MEL_BINS
        assert batch["input_features_compact"].shape[2] < whole["input_features"].shape[2] == 400
        assert torch.equal(with_whole_window(batch, 400)["input_features"], whole["input_features"])
        taps = target.capture(batch, [0, 1], keep_final=True)
        whole_taps = target.capture(whole, [0, 1], keep_final=True)
        assert torch.equal(taps.taps, whole_taps.taps) and torch.equal(taps.final_hidden, whole_taps.final_hidden)
        assert torch.equal(taps.encoder_hidden, whole_taps.encoder_hidden)
        ids, mask, am = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
        prompt = [tok.convert_ids_to_tokens(row) for row in ids[:, :4].tolist()]
        assert {(p[0], p[2], p[3]) for p in prompt} == {("<|startoftranscript|>", "<|transcribe|>", "<|notimestamps|>")}
        languages |= {p[1] for p in prompt}
        assert not mask[:, :4].any()  # the decoder prompt is never supervised
        for row in range(ids.shape[0]):
            real = int(am[row].sum())
            assert mask[row, 5:real].all() and not mask[row, real:].any()
            assert int(ids[row, real - 1]) == tok.eos_token_id  # <|endoftext|> is supervised
            words = tok.decode(ids[row, 4 : real - 1])
            assert words.startswith(" ") and set(words.split()) <= set(tiny.WORDS)  # " " + text, as Whisper writes
        streams = target.streams(batch)
        assert not streams.audio_mask.any() and torch.equal(streams.loss_mask, mask)
    assert languages == {"<|en|>", "<|de|>"}  # lang from the manifest row, default English


def test_waves_batches_give_the_whole_windows_taps_and_a_custom_extractor_keeps_its_features(whisper, tmp_path):
    """`device_features`: the batch holds the padded waves, whose features the frozen target computes (taps bit for
    bit on the CPU); an extractor that is not the standard one for the target falls back to compact features."""
    import copy

    model, processor = whisper
    manifest = str(_manifest(tmp_path))
    target = FrozenTarget(model)

    def batches(proc, **kwargs):
        return build_train_dataloader(manifest, proc, model.config, max_tokens=400, shuffle=False, **kwargs)

    for waves, whole in zip(batches(processor, compact_features=True, device_features=True), batches(processor)):
        assert set(waves) == set(whole) - {"input_features"} | {"input_audio_waves"}
        assert waves["input_audio_waves"].shape[0] == whole["input_ids"].shape[0]  # [batch, samples]
        assert torch.equal(target.whole_window(waves)["input_features"], whole["input_features"])
        got = target.capture(waves, [0, 1], keep_final=True)
        want = target.capture(whole, [0, 1], keep_final=True)
        assert torch.equal(got.taps, want.taps) and torch.equal(got.encoder_hidden, want.encoder_hidden)
    custom = copy.copy(processor)
    custom.feature_extractor = copy.deepcopy(processor.feature_extractor)
    custom.feature_extractor.mel_filters = custom.feature_extractor.mel_filters * 1.5
    batch = next(iter(batches(custom, compact_features=True, device_features=True)))
    assert "input_features_compact" in batch and "input_audio_waves" not in batch


@pytest.mark.slow  # 5 s on 2 busy cores
def test_taps_are_decoder_layer_outputs_before_the_final_layer_norm(whisper):
    model, processor = whisper
    target = FrozenTarget(model)
    ids = torch.tensor([[257, 258, 359, 363, 32, 104, 105, 256]])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.zeros_like(ids),
        "input_features": whisper_features(processor, 0),
    }
    layers = [0, 2, 3]
    feats = target.capture(batch, layers, keep_final=True)
    out = model(input_features=batch["input_features"], decoder_input_ids=ids, output_hidden_states=True)
    h = 32
    for j, layer in enumerate(layers[:-1]):
        torch.testing.assert_close(feats.taps[..., j * h : (j + 1) * h], out.decoder_hidden_states[layer + 1])
    last = feats.taps[..., 2 * h :]  # HF's last hidden state is post-norm: the tap is the raw layer output
    torch.testing.assert_close(model.model.decoder.layer_norm(last), out.decoder_hidden_states[-1])
    assert not torch.allclose(last, out.decoder_hidden_states[-1])
    torch.testing.assert_close(target.lm_head(feats.final_hidden), out.logits)  # target_argmax's head
    # a left-padded row keeps the decoder positions of its real tokens: the same taps as unpadded
    padded = {
        "input_ids": torch.cat([torch.full((1, 3), 256), ids], 1),
        "loss_mask": torch.zeros(1, 11),
        "attention_mask": torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], 1),
        "input_features": batch["input_features"],
    }
    torch.testing.assert_close(target.capture(padded, layers).taps[:, 3:], feats.taps, atol=1e-5, rtol=1e-5)
    assert target.num_layers == 4 and target.text_config.num_hidden_layers == 4  # the decoder's depth
    assert target.mask_token_candidates(processor.tokenizer, limit=3) == [364, 365, 366]


def test_target_labels_leave_out_the_tokens_generate_suppresses(whisper, text_target_4x64):
    """`target_argmax` / `target_distribution` labels are the target's greedy next token as `generate` (and so the
    verify step) writes it: never an id of `generation_config.suppress_tokens`; a target without any keeps its head."""
    from dflash_hf.objective.labels.target_distribution import topk_distribution

    model, _ = whisper
    target = FrozenTarget(model)
    suppressed = model.generation_config.suppress_tokens
    assert target.suppressed_ids == sorted(set(suppressed))
    head = target.lm_head.weight  # tied to the embedding: a state along a token's row scores that token highest
    hidden = torch.randn(1, 6, head.shape[1]) * 0.1
    hidden[0, 1], hidden[0, 3] = 50 * head[suppressed[0]], 50 * head[suppressed[1]]
    ids = torch.tensor([[257, 258, 359, 363, 32, 104]])
    mask, docs = torch.tensor([[0, 0, 1, 1, 1, 1]]), torch.zeros(1, 6, dtype=torch.long)
    raw = target.lm_head(hidden)
    assert raw[0, 1].argmax() == suppressed[0] and raw[0, 3].argmax() == suppressed[1]  # the case that matters
    expected = raw.index_fill(-1, torch.tensor(suppressed), float("-inf")).argmax(-1)
    labels = target_argmax_labels(target, hidden, ids, mask, docs, chunk_size=128)
    assert labels[0, 2:].tolist() == expected[0, 1:5].tolist()  # label[t] from the state at t-1
    assert not set(labels[0, 2:].tolist()) & set(suppressed)
    soft = topk_distribution(target.label_logits, hidden, ids, mask, docs, top_k=4, chunk_size=128)
    assert not set(soft.ids[0, 2:].flatten().tolist()) & set(suppressed)
    assert soft.ids[0, 2:, 0].tolist() == labels[0, 2:].tolist()
    beyond = FrozenTarget(model)  # a generation config listing ids past the vocabulary: `generate` ignores them
    beyond.suppressed_ids = [*target.suppressed_ids, head.shape[0] + 5]
    assert torch.equal(beyond.label_logits(hidden), target.label_logits(hidden))
    text, _ = text_target_4x64
    plain = FrozenTarget(text)
    state = torch.ones(2, 64)
    assert plain.suppressed_ids == [] and torch.equal(plain.label_logits(state), plain.lm_head(state))


@pytest.mark.compat
@pytest.mark.slow  # 60 s on 2 busy cores
def test_speculative_greedy_equals_whisper_generate_and_custom_generate(whisper):
    model, processor = whisper
    target = FrozenTarget(model)
    draft = whisper_draft(target)
    for seed in range(2):
        feats = whisper_features(processor, seed)
        ref = model.generate(feats, max_new_tokens=24, return_dict_in_generate=True).sequences
        out = speculative_generate(draft, model, 24, input_features=feats)
        assert torch.equal(out.sequences, ref), seed
        assert all(1 <= a <= BLOCK for a in out.acceptance_lengths)
        assert out.num_target_forwards == len(out.acceptance_lengths) + 1
        plain = model.generate(feats, max_new_tokens=24)
        assert torch.equal(
            model.generate(feats, max_new_tokens=24, custom_generate=dflash_custom_generate(draft)), plain
        )
    # a draft that always agrees: whole blocks accepted, the output is still the target's (processors applied);
    # the encoder and each layer's cross-attention keys run once for the utterance, not once per cycle
    ref = model.generate(feats, max_new_tokens=24, return_dict_in_generate=True).sequences
    calls = {"encoder": 0, "cross_keys": 0}
    hooks = [
        model.model.encoder.register_forward_hook(lambda *_: calls.__setitem__("encoder", calls["encoder"] + 1)),
        model.model.decoder.layers[0].encoder_attn.k_proj.register_forward_hook(
            lambda *_: calls.__setitem__("cross_keys", calls["cross_keys"] + 1)
        ),
    ]
    out = speculative_generate(scripted_draft(whisper_draft(target), ref, 4), model, 24, input_features=feats)
    for h in hooks:
        h.remove()
    assert torch.equal(out.sequences, ref)
    assert out.acceptance_lengths[0] == BLOCK and len(out.acceptance_lengths) > 2
    assert calls == {"encoder": 1, "cross_keys": 1}
    # an audio decoder-only target (Qwen3-ASR) through custom_generate too
    asr, _, inputs = tiny_qwen3_asr_prompt()
    asr_draft = DFlashDraftModel(
        DFlashConfig.from_target_config(
            FrozenTarget(asr).text_config, mask_token_id=262, num_hidden_layers=1, block_size=BLOCK
        )
    ).eval()
    assert torch.equal(
        asr.generate(**inputs, max_new_tokens=12, do_sample=False, custom_generate=dflash_custom_generate(asr_draft)),
        asr.generate(**inputs, max_new_tokens=12, do_sample=False),
    )
    # an explicit decoder prompt (another language) is what generate takes as decoder_input_ids
    prompt = torch.tensor([[257, 259, 359, 363]])
    ref = model.generate(feats, decoder_input_ids=prompt, max_new_tokens=10, return_dict_in_generate=True).sequences
    out = speculative_generate(draft, model, 10, input_features=feats, decoder_input_ids=prompt)
    assert torch.equal(out.sequences, ref) and torch.equal(out.sequences[:, :4], prompt)


@pytest.mark.slow  # 242 s on 2 busy cores
def test_target_greedy_equals_the_dict_generate_without_its_cache_copy(whisper):
    """`target_generate` takes Whisper's plain `generate` (no cache copy to the CPU) and gives the dict call's
    sequences: the prompt back in front, the end token back where a row ended, rows of a batch padded alike."""
    model, processor = whisper
    eos, prompt = processor.tokenizer.eos_token_id, torch.tensor([[257, 258, 359, 363]])
    feats = torch.cat([whisper_features(processor, seed) for seed in range(4)])
    # the tiny target never ends on its own: give the end token the output row of a token it writes late
    late = model.generate(feats[:1], decoder_input_ids=prompt, max_new_tokens=24)[0].tolist()
    late = next(t for t in late if t != late[0])
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.proj_out.weight[eos] = model.proj_out.weight[late] * 1.05
    target = FrozenTarget(model)
    ended = capped = 0
    for n in (2, 6, 24):
        ref = model.generate(
            feats, decoder_input_ids=prompt.repeat(4, 1), max_new_tokens=n, return_dict_in_generate=True
        ).sequences
        for row in range(4):  # one utterance at a time, as dflash-eval decodes
            one = model.generate(
                feats[row : row + 1], decoder_input_ids=prompt, max_new_tokens=n, return_dict_in_generate=True
            ).sequences
            got = target_generate.target_generate(
                target, {"input_features": feats[row : row + 1], "decoder_input_ids": prompt}, n
            )
            assert torch.equal(got, one), (n, row)
            ended += int(one[0, -1]) == eos
            capped += one.shape[1] == 4 + n and int(one[0, -1]) != eos
        got = target_generate.target_generate(
            target, {"input_features": feats, "decoder_input_ids": prompt.repeat(4, 1)}, n
        )
        assert torch.equal(got, ref), n
    assert ended and capped  # both ways a decode stops were seen
    calls = []  # and without the dict call's cache copy: the plain call, once
    generate = model.generate
    model.generate = lambda *a, **kw: calls.append(kw.get("return_dict_in_generate")) or generate(*a, **kw)
    target_generate.target_generate(target, {"input_features": feats[:1], "decoder_input_ids": prompt}, 6)
    del model.generate
    assert calls == [False]
    new = target_generate.target_generate_new_tokens(
        target, {"input_features": feats, "decoder_input_ids": prompt.repeat(4, 1)}, 24
    )
    assert torch.equal(new, ref[:, 4:]) and int(new[0, -1]) == eos
    # where the plain call could differ, the dict call's sequences: a timestamp token in the output (Whisper then
    # splits segments and decodes on), a pad token other than the end token, several end tokens
    stamps = copy.deepcopy(model)
    with torch.no_grad():
        stamps.proj_out.weight[370] = stamps.proj_out.weight[late] * 1.1  # <|0.12|> wins where `late` would
    pad = copy.deepcopy(model)
    pad.generation_config.pad_token_id = late
    ends = copy.deepcopy(model)
    ends.generation_config.eos_token_id = [eos, late]
    for odd in (stamps, pad, ends):
        for n in (8, 25):
            one = {"input_features": feats[:1], "decoder_input_ids": prompt}
            ref = odd.generate(**one, max_new_tokens=n, return_dict_in_generate=True).sequences
            assert torch.equal(target_generate.target_generate(FrozenTarget(odd), one, n), ref), n


@pytest.mark.compat
def test_speculative_sampling_applies_whispers_logits_processors(whisper):
    """At T > 0 the target's distribution is the processed one: suppressed tokens are never emitted, even though
    the unsuppressed target prefers them and a random draft proposes anything."""
    model, processor = whisper
    feats = whisper_features(processor, 1)
    greedy = model.generate(feats, max_new_tokens=12, return_dict_in_generate=True).sequences[0, 4:].tolist()
    model = copy.deepcopy(model)
    banned = sorted(set(greedy) - {processor.tokenizer.eos_token_id})
    model.generation_config.suppress_tokens = list(model.generation_config.suppress_tokens) + banned
    draft = whisper_draft(FrozenTarget(model))
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        out = speculative_generate(draft, model, 12, temperature=1.0, generator=gen, input_features=feats)
        assert out.sequences[0, :4].tolist() == [257, 258, 359, 363]
        new = out.sequences[0, 4:].tolist()
        assert 0 < len(new) <= 12 and not set(new) & set(banned), (new, banned)
        assert new[0] not in model.generation_config.begin_suppress_tokens
        assert all(1 <= a <= BLOCK for a in out.acceptance_lengths)


@pytest.mark.compat
def test_decoding_stops_at_an_end_token_accepted_inside_a_block():
    """The target emits its end token in the middle of a block: decoding stops there and the cycle counts only
    the tokens up to it (it used to go on to the next cycle and count the whole block)."""
    model, _ = tiny_text_target()
    target = FrozenTarget(tiny.sharpen(model))
    prompt = torch.randint(3, 250, (1, 7), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(prompt)
    free = model.generate(input_ids=prompt, attention_mask=am, max_new_tokens=12, do_sample=False)
    new_tokens = free[0, 7:].tolist()
    # the end token: a new token first seen mid-block (new token j is slot j % BLOCK of its cycle)
    j = next(j for j in range(5, 12) if j % BLOCK and new_tokens[j] not in new_tokens[:j])
    model.generation_config.eos_token_id = new_tokens[j]
    ref = model.generate(input_ids=prompt, attention_mask=am, max_new_tokens=12, do_sample=False)
    first_eos = 7 + j
    assert ref.shape[1] == first_eos + 1
    cfg = DFlashConfig.from_target_config(target.text_config, mask_token_id=262, num_hidden_layers=1, block_size=BLOCK)
    draft = scripted_draft(DFlashDraftModel(cfg).eval(), free, 7)
    out = speculative_generate(draft, model, 12, input_ids=prompt, attention_mask=am)
    assert torch.equal(out.sequences, ref)
    new = first_eos + 1 - 7
    assert sum(out.acceptance_lengths) == new - 1  # the first new token comes from the prompt's forward
    assert out.acceptance_lengths[:-1] == [BLOCK] * (len(out.acceptance_lengths) - 1)
    assert out.acceptance_lengths[-1] < BLOCK  # the end token was accepted mid-block
    custom = dflash_custom_generate(scripted_draft(DFlashDraftModel(cfg).eval(), free, 7))
    assert torch.equal(
        model.generate(input_ids=prompt, attention_mask=am, max_new_tokens=12, do_sample=False, custom_generate=custom),
        ref,
    )
    assert custom.acceptance_lengths == out.acceptance_lengths
    # a user's own stopping criterion is checked after every accepted token too
    model.generation_config.eos_token_id = None

    class StopOn(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == new_tokens[j]

    kw = dict(
        input_ids=prompt,
        attention_mask=am,
        max_new_tokens=12,
        do_sample=False,
        stopping_criteria=StoppingCriteriaList([StopOn()]),
    )
    custom = dflash_custom_generate(scripted_draft(DFlashDraftModel(cfg).eval(), free, 7))
    assert torch.equal(model.generate(**kw, custom_generate=custom), model.generate(**kw))
    assert sum(custom.acceptance_lengths) == new - 1


def test_too_long_transcripts_and_audio_and_unknown_languages_are_bad_samples(whisper, tmp_path):
    model, processor = whisper
    long_audio = tiny.synthesize_speech(tmp_path / "long", 1, min_dur=4.5, max_dur=4.6)  # the tiny window: 4 s
    cases = [
        ({1: {"text": "yes " * 120}}, r"field 'text'.*more than the target's 448"),
        ({2: {"lang": "klingon"}}, r"field 'lang'"),
        (
            {3: json.loads(long_audio.read_text()) | {"audio_filepath": str(long_audio.parent / "audio/utt-0000.wav")}},
            r"field 'duration'.*longer than Whisper's 4 s window",
        ),
    ]
    for i, (extra, message) in enumerate(cases):
        manifest = str(_manifest(tmp_path / str(i), extra))
        # the characters-per-second check would refuse the long text first: off, so the target's limit is what fires
        kw = dict(max_tokens=4000, max_chars_per_second=0)
        with pytest.raises(BadSampleError, match=message):
            build_train_dataloader(manifest, processor, model.config, **kw)
        loader = build_train_dataloader(manifest, processor, model.config, skip_bad_samples=True, **kw)
        assert sum(b["input_ids"].shape[0] for b in loader) == 5 and loader.bad_samples.num_skipped == 1


def test_manifest_context_is_whispers_previous_text_prompt(whisper, tmp_path):
    model, processor = whisper
    tok = processor.tokenizer
    manifest = _manifest(tmp_path, {i: {"context": "go left"} for i in range(6)})
    batch = next(iter(build_train_dataloader(str(manifest), processor, model.config, max_tokens=4000)))
    row = batch["input_ids"][0, : int(batch["attention_mask"][0].sum())]
    sot = int((row == tok.convert_tokens_to_ids("<|startoftranscript|>")).nonzero())
    assert tok.decode(row[:sot]) == "<|startofprev|> go left"
    assert not batch["loss_mask"][0, : sot + 4].any()
    # the token budget counts the decoder stream as encoded (no second start-of-transcript prefix)
    from dflash_hf.data import ConversationRenderer, open_source
    from dflash_hf.data.bad_samples import BadSamples
    from dflash_hf.data.sample_checks import SampleValidator

    family = FrozenTarget(model).family
    validator = SampleValidator(
        ConversationRenderer(processor, family), family, model.config, max_tokens=None, bad=BadSamples()
    )
    counts = sorted(validator.count_tokens(cut) for cut in open_source(manifest))
    lengths = [
        n
        for b in build_train_dataloader(str(manifest), processor, model.config, max_tokens=4000)
        for n in b["attention_mask"].sum(-1).tolist()
    ]
    assert counts == sorted(lengths)
    with pytest.raises(ValueError, match="field 'system_prompt'"):
        build_train_dataloader(
            str(manifest),
            processor,
            model.config,
            max_tokens=4000,
            conversation=ConversationConfig(system_prompt="Be brief."),
        )


@pytest.mark.compat
@pytest.mark.slow  # 6 s on 2 busy cores
def test_dflash_train_on_a_whisper_target_from_a_manifest(tmp_path):
    from dflash_hf.cli import train as cli_train

    target_dir = tiny.save_tiny_target(tmp_path / "target", kind="whisper", hidden_size=32, num_heads=2)
    metrics = cli_train.run(
        [
            "--target_name_or_path",
            str(target_dir),
            "--train_data",
            str(_manifest(tmp_path)),
            "--mask_token_id",
            str(MASK),
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "2",
            "--block_size",
            str(BLOCK),
            "--num_draft_layers",
            "1",
            "--use_cpu",
            "true",
            "--report_to",
            "none",
            "--max_tokens",
            "400",
            "--label_source",
            "target_argmax",
            "--disable_tqdm",
            "true",
            "--save_strategy",
            "no",
        ]
    )
    assert np.isfinite(metrics["train_loss"]) and metrics["skipped_samples"] == 0
    cfg = json.loads((tmp_path / "out" / "draft" / "config.json").read_text())
    assert cfg["num_target_layers"] == 4 and cfg["dflash_config"]["target_layer_ids"] == [2]
    assert cfg["hidden_size"] == 32 and cfg["vocab_size"] == 380


def test_dflash_eval_and_generate_labels_on_a_whisper_target(tmp_path):
    from dflash_hf.cli import eval as cli_eval
    from dflash_hf.cli import generate_labels

    model, processor = tiny.build_whisper_target(hidden_size=32, num_heads=2, seed=2)
    target_dir = tmp_path / "target"
    tiny.sharpen(model, seed=2).save_pretrained(target_dir)
    processor.save_pretrained(target_dir)
    whisper_draft(FrozenTarget(model)).save_pretrained(tmp_path / "draft")
    manifest = _manifest(tmp_path)
    out = tmp_path / "eval.json"
    assert (
        cli_eval.main(
            [
                "--draft",
                str(tmp_path / "draft"),
                "--target",
                str(target_dir),
                "--data",
                str(manifest),
                "--num_samples",
                "2",
                "--max_new_tokens",
                "8",
                "--output_json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["prompts"] == 2 and res["outputs_identical"] and 1.0 <= res["tau"] <= BLOCK

    labels = tmp_path / "labels.jsonl"
    assert (
        generate_labels.main(
            [
                "--model",
                str(target_dir),
                "--manifest",
                str(manifest),
                "--output",
                str(labels),
                "--batch_size",
                "4",
                "--max_new_tokens",
                "6",
            ]
        )
        == 0
    )
    got = [json.loads(line) for line in labels.read_text().splitlines()]
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert len(got) == len(rows) and got[0]["lang"] == "de"
    # each label is the target's own greedy transcript of that utterance (in its manifest language)
    for row, line in zip(rows[:2], got[:2]):
        import soundfile as sf

        audio, _ = sf.read(manifest.parent / row["audio_filepath"], dtype="float32")
        feats = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt")["input_features"]
        ids = model.generate(feats, language=row.get("lang", "en"), max_new_tokens=6)
        assert line["text"] == processor.tokenizer.decode(ids[0], skip_special_tokens=True).strip()


@pytest.mark.slow  # 30 s on 2 busy cores
def test_overfit_one_utterance_then_accept_full_blocks(tmp_path):
    """The classic-bug gate on the decoder stream: a draft overfit on one utterance's greedy transcript accepts
    whole blocks when decoding it (a tap, position, label or prompt offset would leave acceptance near 1)."""
    from utils import ListDataset, make_args

    from dflash_hf import DFlashTrainer

    model, processor = tiny.build_whisper_target(hidden_size=32, num_heads=2, seed=2)
    tiny.sharpen(model, seed=2, embed_std=1.0, layer_std=0.3)
    feats = whisper_features(processor, 0)
    full = model.generate(feats, max_new_tokens=40, return_dict_in_generate=True).sequences
    assert len(set(full[0, 4:].tolist())) > 10  # a varied transcript, not one repeated token
    ids = full.clone()
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "input_features": feats,
        "loss_mask": torch.arange(ids.shape[1])[None] >= 4,
    }
    block, steps = 8, 200
    torch.manual_seed(0)
    trainer = DFlashTrainer(
        args=make_args(
            tmp_path,
            mask_token_id=MASK,
            block_size=block,
            num_draft_layers=1,
            max_steps=steps,
            per_device_train_batch_size=1,
            learning_rate=3e-3,
            label_source="target_argmax",
        ),
        target=model,
        train_dataset=ListDataset([0], steps),
        data_collator=lambda _: dict(batch),
    )
    trainer.train()
    out = speculative_generate(trainer.model.eval(), model, 40, input_features=feats)
    assert torch.equal(out.sequences, full)
    assert out.tau >= 0.75 * block, out.acceptance_lengths


def test_packing_is_refused_for_whisper(whisper):
    """A packed decoder row would need one encoder input per document: refused, naming packing."""
    from dflash_hf.data.packing import check_family_packable

    with pytest.raises(ValueError, match=r"packing=True is not supported for the encoder-decoder family 'whisper'"):
        check_family_packable(FrozenTarget(whisper[0]).family)


def test_real_tau_rows_pass_the_sample_validator_and_skip_policy(whisper, tmp_path):
    """The real-tau callback's and dflash-eval's rows go through training's validator: an unknown language is a
    BadSampleError, or skipped with skip_bad_samples (before: it reached the collator unchecked)."""
    from dflash_hf.data.eval_rows import speech_rows_and_collator

    model, processor = whisper
    manifest = _manifest(tmp_path, {1: {"lang": "xx"}})
    rows, _ = speech_rows_and_collator(str(manifest), processor, model.config)
    with pytest.raises(BadSampleError, match="lang"):
        list(rows)
    rows, _ = speech_rows_and_collator(str(manifest), processor, model.config, skip_bad_samples=True)
    assert len(list(rows)) == 5


def test_decode_benchmark_gives_a_bf16_whisper_its_features_in_bf16(whisper):
    from dflash_hf.generation.evaluation import decode_benchmark

    model, processor = whisper
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    draft = whisper_draft(FrozenTarget(bf16)).to(torch.bfloat16)
    prompt = torch.tensor([[257, 258, 359, 363]])
    inputs = {
        "input_ids": prompt,
        "attention_mask": torch.ones_like(prompt),
        "input_features": whisper_features(processor, 0),
    }
    assert inputs["input_features"].dtype == torch.float32  # as the collator emits them
    stats = decode_benchmark(draft, bf16, [inputs], 8, warmup=False)
    assert stats.prompts == 1 and not stats.mismatches and stats.spec_tokens > 0


def test_greedy_and_speculative_decoding_do_not_repeat_the_max_length_warning(whisper):
    """Whisper's generation config sets max_length (448): transformers warns on every `generate(max_new_tokens=...)`;
    the package's decoders pass max_new_tokens on purpose and drop that one warning (once per prompt otherwise)."""
    import logging

    model, processor = whisper
    feats = whisper_features(processor, 0)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("transformers.generation.utils")
    log.addHandler(handler)
    try:
        model.generate(input_features=feats, max_new_tokens=4)  # transformers' own call warns
        assert any("seem to have been set" in r.getMessage() for r in records)
        records.clear()
        ft = FrozenTarget(model)
        target_generate.target_generate(ft, {"input_features": feats}, 4)
        speculative_generate(whisper_draft(model), ft, 4, input_features=feats)
        assert not any("seem to have been set" in r.getMessage() for r in records)
        model.generate(input_features=feats, max_new_tokens=4)  # the filter is gone afterwards
        assert any("seem to have been set" in r.getMessage() for r in records)
    finally:
        log.removeHandler(handler)


def test_training_on_waves_or_compact_features_equals_training_on_the_whole_window(whisper, tmp_path, monkeypatch):
    """The trainer's Whisper loader gives compact features on the CPU (the frames that hold audio), whose window the
    frozen target rebuilds, and on a GPU the padded waves (its extractor is the standard one), whose features the
    target computes (forced here): two steps end on the same draft, bit for bit, as with the processor's whole
    window."""
    from utils import make_args

    import dflash_hf.data as data
    from dflash_hf import DFlashTrainer
    from dflash_hf.training.training_args import DFlashDataArguments

    model, processor = whisper
    manifest = str(_manifest(tmp_path))

    def trained(name: str, **loader):
        monkeypatch.setattr(data, "build_train_dataloader", lambda *a, **k: build(*a, **{**k, **loader}))
        torch.manual_seed(0)
        args = make_args(
            tmp_path / name,
            mask_token_id=MASK,
            max_steps=2,
            label_source="target_argmax",
            target_layer_ids=[0, 1],
            num_draft_layers=1,
        )
        trainer = DFlashTrainer(
            args=args,
            target=model,
            processor=processor,
            train_dataset=[manifest],
            data_args=DFlashDataArguments(max_tokens=400),
        )
        keys.append(set(next(iter(trainer.get_train_dataloader()))))
        trainer.train()
        return trainer.model.state_dict()

    keys, build = [], data.build_train_dataloader
    waves = trained("waves", device_features=True)
    compact = trained("compact")
    whole = trained("whole", device_features=False, compact_features=False)
    assert "input_audio_waves" in keys[0] and "input_features_compact" in keys[1] and "input_features" in keys[2]
    for got in (waves, compact):
        assert got.keys() == whole.keys() and all(torch.equal(got[k], whole[k]) for k in got)
