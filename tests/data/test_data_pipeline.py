import json

import numpy as np
import pytest
import soundfile as sf
import torch

from dflash_hf.data import (
    BadSampleError,
    ConversationConfig,
    DataSource,
    build_train_dataloader,
    open_source,
)
from dflash_hf.targets.families.registry import resolve_family
from dflash_hf.testing import tiny


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return {fmt: tiny.synthesize_speech(root / fmt, 10, seed=i, fmt=fmt) for i, fmt in enumerate(("wav", "flac"))}


def _all_batches(loader):
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def _ids(tok, s):
    return tok(s, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_manifest_to_batch_exact_tokens_and_loss_mask(tmp_path, asr_target, fmt):
    model, processor = asr_target
    tok = processor.tokenizer
    audio = (0.1 * np.random.default_rng(0).standard_normal(24000)).astype(np.float32)
    sf.write(tmp_path / f"a.{fmt}", audio, 16000)
    line = {
        "audio_filepath": f"a.{fmt}",
        "duration": 1.0,
        "offset": 0.25,
        "text": "yes no",
        "lang": "en",
        "context": "Say it:",
        "speaker": "s1",
    }
    (tmp_path / "m.json").write_text(json.dumps(line) + "\n")
    cut = next(iter(open_source(tmp_path / "m.json")))
    assert cut.id == "m-00000000" and cut.start == 0.25 and cut.duration == 1.0
    assert cut.supervisions[0].language == "en" and cut.custom == {
        "context": "Say it:",
        "speaker": "s1",
        "dflash_origin": f"{tmp_path / 'm.json'} line 1",
    }

    loader = build_train_dataloader(
        tmp_path / "m.json",
        processor,
        model.config,
        max_tokens=500,
        shuffle=False,
        conversation=ConversationConfig(system_prompt="SYS"),
    )
    (batch,) = list(loader)
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask", "input_features", "input_features_mask"}
    n_audio = int(processor._get_audio_token_length(torch.tensor([100]))[0])  # 1.0 s = 100 mel frames
    sp = {t: tok.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS}
    expected = (
        [sp[tiny.IM_START]]
        + _ids(tok, "system\nSYS")
        + [sp[tiny.IM_END]]
        + _ids(tok, "\n")
        + [sp[tiny.IM_START]]
        + _ids(tok, "user\nSay it:")
        + [sp[tiny.AUDIO_START]]
        + [sp[tiny.AUDIO_PAD]] * n_audio
        + [sp[tiny.AUDIO_END], sp[tiny.IM_END]]
        + _ids(tok, "\n")
        + [sp[tiny.IM_START]]
        + _ids(tok, "assistant\n")
        + _ids(tok, "yes no")
        + [sp[tiny.IM_END]]
        + _ids(tok, "\n")
    )
    assert batch["input_ids"][0].tolist() == expected
    supervised = batch["input_ids"][0][batch["loss_mask"][0]].tolist()
    assert supervised == _ids(tok, "yes no") + [sp[tiny.IM_END]]
    # the supervised span is contiguous and ends right before the trailing newline
    pos = batch["loss_mask"][0].nonzero().flatten().tolist()
    assert pos == list(range(len(expected) - 8, len(expected) - 1))
    # the audio window honours offset/duration: 1.0 s of mel frames valid
    assert int(batch["input_features_mask"][0].sum()) == 100
    with torch.no_grad():
        model(**{k: v for k, v in batch.items() if k != "loss_mask"})


def test_batches_follow_token_budget_padding_side_and_target_forward(asr_target, corpus):
    model, processor = asr_target
    loader = build_train_dataloader([corpus["wav"], corpus["flac"]], processor, model.config, max_tokens=160, seed=3)
    batches = _all_batches(loader)
    assert sum(len(b["input_ids"]) for b in batches) == 20  # every cut of both sources, once
    for b in batches:
        assert b["input_ids"].numel() <= 160
        assert (b["attention_mask"][:, -1] == 1).all()  # Qwen3-ASR pads on the left
        assert not b["loss_mask"][b["attention_mask"] == 0].any()
        audio = b["input_ids"] == model.config.audio_token_id
        assert not (b["loss_mask"] & audio).any()
        assert (b["loss_mask"].sum(-1) > 0).all()
    right = build_train_dataloader(corpus["wav"], processor, model.config, max_tokens=160, padding_side="right")
    b = next(iter(right))
    assert (b["attention_mask"][:, 0] == 1).all()
    sup = b["input_ids"][b["loss_mask"]]
    assert (sup == processor.tokenizer.eos_token_id).sum() == len(b["input_ids"])  # one closing token per row


@pytest.mark.slow  # 5 s on 2 busy cores
def test_deterministic_seed_and_rank_sharding(asr_target, corpus):
    model, processor = asr_target

    def ids(**kw):
        loader = build_train_dataloader(corpus["wav"], processor, model.config, max_tokens=160, **kw)
        return [b["input_ids"].tolist() for b in loader]

    assert ids(seed=1) == ids(seed=1)
    assert ids(seed=1) != ids(seed=2)
    r0, r1 = ids(seed=1, world_size=2, rank=0), ids(seed=1, world_size=2, rank=1)
    assert r0 and r1 and r0 != r1
    with pytest.raises(ValueError, match="rank"):
        ids(world_size=2, rank=2)


def test_resume_mid_epoch_restores_position(asr_target, corpus):
    model, processor = asr_target
    kw = dict(max_tokens=120, seed=5)
    reference = _all_batches(build_train_dataloader(corpus["flac"], processor, model.config, **kw))
    assert len(reference) >= 4
    loader = build_train_dataloader(corpus["flac"], processor, model.config, **kw)
    it = iter(loader)
    seen = [next(it) for _ in range(2)]
    state = loader.state_dict()
    assert state["batches_consumed"] == 2 and state["epoch"] == 0
    resumed = build_train_dataloader(corpus["flac"], processor, model.config, num_workers=1, **kw)
    resumed.load_state_dict(state)
    rest = _all_batches(resumed)
    assert len(seen) + len(rest) == len(reference)
    for got, want in zip(seen + rest, reference):
        assert all(torch.equal(got[k], want[k]) for k in want)
    # a new epoch reshuffles
    resumed.set_epoch(1)
    epoch1 = _all_batches(resumed)
    assert [b["input_ids"].tolist() for b in epoch1] != [b["input_ids"].tolist() for b in reference]


def test_hf_dataset_paths_and_arrays_and_mixing(tmp_path, asr_target, corpus):
    from datasets import Dataset

    model, processor = asr_target
    lines = [json.loads(x) for x in corpus["wav"].read_text().splitlines()][:3]
    paths = [str(corpus["wav"].parent / x["audio_filepath"]) for x in lines]
    ds_paths = Dataset.from_dict({"audio": paths, "text": [x["text"] for x in lines]})
    arrays = [{"array": sf.read(p, dtype="float32")[0], "sampling_rate": 16000} for p in paths]
    ds_arrays = Dataset.from_dict({"audio": arrays, "text": [x["text"] for x in lines], "context": ["Ctx"] * 3})
    loaders = [
        build_train_dataloader(
            DataSource(hf_dataset=ds, path=name), processor, model.config, max_tokens=10_000, shuffle=False
        )
        for ds, name in ((ds_paths, "p"), (ds_arrays, "a"))
    ]
    (bp,), (ba,) = (list(loader) for loader in loaders)
    assert torch.allclose(bp["input_features"], ba["input_features"], atol=1e-3)
    tok = processor.tokenizer
    assert "Ctx" in tok.decode(ba["input_ids"][0]) and "Ctx" not in tok.decode(bp["input_ids"][0])
    mixed = build_train_dataloader(
        [DataSource(path=str(corpus["wav"]), weight=3.0), DataSource(hf_dataset=ds_arrays, path="a")],
        processor,
        model.config,
        max_tokens=10_000,
        shuffle=False,
        max_batch_size=1,
    )
    texts = [tok.decode(b["input_ids"][0]) for b in mixed]
    assert len(texts) == 13 and sum("Ctx" in t for t in texts) == 3


def test_lhotse_cutset_file_is_read_lazily(tmp_path, asr_target, corpus):
    model, processor = asr_target
    cuts = open_source(corpus["wav"]).to_eager()
    cuts.to_file(tmp_path / "cuts.jsonl.gz")
    lazy = open_source(tmp_path / "cuts.jsonl.gz")
    assert lazy.is_lazy and [c.id for c in lazy] == [c.id for c in cuts]
    loader = build_train_dataloader(tmp_path / "cuts.jsonl.gz", processor, model.config, max_tokens=10_000)
    assert sum(len(b["input_ids"]) for b in loader) == 10


def test_text_family_loader(tmp_path):
    from datasets import Dataset

    tok = tiny.build_tokenizer()
    model = tiny.build_text_target(tok, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    assert resolve_family(model.config).name == "text"
    ds = Dataset.from_dict({"text": ["four", "six"], "context": ["2+2?", "3+3?"]})
    loader = build_train_dataloader(
        DataSource(hf_dataset=ds, audio_column=None, path="t"),
        tok,
        model.config,
        max_tokens=1000,
        shuffle=False,
        padding_side="right",
    )
    (b,) = list(loader)
    assert set(b) == {"input_ids", "attention_mask", "loss_mask"}
    assert tok.decode(b["input_ids"][0][b["loss_mask"][0]]) == "four<|im_end|>"
    assert tok.decode(b["input_ids"][1][b["loss_mask"][1]]) == "six<|im_end|>"


def test_skip_summary_and_num_workers(tmp_path, asr_target, corpus):
    model, processor = asr_target
    lines = corpus["wav"].read_text().splitlines()
    bad = json.loads(lines[0])
    bad["text"] = "  "
    manifest = corpus["wav"].parent / "with_bad.json"
    manifest.write_text("\n".join([json.dumps(bad)] + lines[1:]) + "\n")
    with pytest.raises(BadSampleError, match=r"with_bad-00000000.*'text'.*empty"):
        list(build_train_dataloader(manifest, processor, model.config, max_tokens=160))
    loader = build_train_dataloader(
        manifest, processor, model.config, max_tokens=160, skip_bad_samples=True, num_workers=2
    )
    assert sum(len(b["input_ids"]) for b in loader) == 9
    assert loader.bad_samples.num_skipped == 1
    assert "with_bad-00000000" in loader.bad_samples.summary()


def test_token_counts_are_remembered_by_content(tmp_path, asr_target):
    """A second epoch's counts come from the validator's memory, keyed by what decides them: the same id with
    another text or another duration is counted again, and every count equals a fresh validator's."""
    from dataclasses import replace

    from lhotse.utils import fastcopy

    from dflash_hf.data import BadSamples, ConversationRenderer
    from dflash_hf.data.sample_checks import SampleValidator

    model, processor = asr_target
    family = resolve_family(model.config)

    def validator():
        return SampleValidator(
            ConversationRenderer(processor, family), family, model.config, max_tokens=None, bad=BadSamples(skip=False)
        )

    cuts = list(open_source(tiny.synthesize_speech(tmp_path, 3, min_dur=0.6, max_dur=1.6)))
    remembering = validator()
    renders = []
    render_text = remembering.renderer.render_text
    remembering.renderer.render_text = lambda *a, **k: renders.append(1) or render_text(*a, **k)
    first = [remembering.token_counts(c) for c in cuts]
    assert len(renders) == 3 and first == [validator().token_counts(c) for c in cuts]
    assert [remembering.token_counts(c) for c in cuts] == first and len(renders) == 3  # the second epoch: remembered
    longer_text = fastcopy(cuts[0], supervisions=[replace(cuts[0].supervisions[0], text="a much longer reply " * 4)])
    shorter = cuts[1].truncate(duration=cuts[1].duration / 2)
    assert longer_text.id == cuts[0].id
    for changed, before in ((longer_text, first[0]), (shorter, first[1])):
        assert remembering.token_counts(changed) != before
        assert remembering.token_counts(changed) == validator().token_counts(changed)
    assert len(renders) == 5


def test_a_manifest_reads_each_audio_header_once_until_the_file_changes(tmp_path, monkeypatch):
    from dflash_hf.data import sources

    manifest = tiny.synthesize_speech(tmp_path, 3, min_dur=0.6, max_dur=1.0)
    reads = []
    from_file = sources.Recording.from_file
    monkeypatch.setattr(sources.Recording, "from_file", lambda *a, **k: reads.append(a[0]) or from_file(*a, **k))
    nemo = sources.NemoManifest(manifest)
    first = [c.recording for c in nemo]
    assert len(reads) == 3 and [c.recording for c in nemo] == first and len(reads) == 3  # the next epoch
    path = first[0].sources[0].source
    sf.write(path, np.zeros(8000, dtype=np.float32), 16000)  # rewritten: another size, another header
    again = [c.recording for c in nemo]
    assert len(reads) == 4 and again[0].num_samples == 8000 and again[1:] == first[1:]


def test_rendered_prompts_are_remembered_and_rerendered_when_they_no_longer_fit(tmp_path, asr_target):
    """Samples sharing a user turn render its generation prompt once; every rendered sample equals a fresh
    renderer's; a template whose output changes (one that prints the date) gets its prompt rendered again."""
    from lhotse.utils import fastcopy

    from dflash_hf.data import ConversationRenderer

    model, processor = asr_target
    family = resolve_family(model.config)
    cuts = list(open_source(tiny.synthesize_speech(tmp_path, 4, min_dur=0.6, max_dur=1.0)))
    cuts[3] = fastcopy(cuts[3], custom={**(cuts[3].custom or {}), "context": "Another instruction."})
    renderer = ConversationRenderer(processor, family)
    calls, day = [], ["Monday"]
    apply = renderer._apply

    def dated(messages, **kw):
        calls.append(kw["add_generation_prompt"])
        return f"[{day[0]}]" + apply(messages, **kw)

    renderer._apply = dated
    fresh = ConversationRenderer(processor, family)
    fresh._apply = lambda messages, **kw: f"[{day[0]}]" + apply(messages, **kw)
    assert renderer.render_many(cuts) == [fresh.render(c) for c in cuts]  # one tokenizer call, or one a cut
    assert calls.count(True) == 2 and calls.count(False) == 4  # two distinct user turns, four conversations
    day[0] = "Tuesday"
    assert renderer.render(cuts[0]) == fresh.render(cuts[0]) and calls.count(True) == 3


def _per_row_supervision(input_ids, attention_mask, samples):
    """The loss mask row by row: each row's last `len(suffix_ids)` real tokens carry its flags."""
    loss_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, sample in enumerate(samples):
        tail = attention_mask[row].nonzero().flatten()[-len(sample.suffix_ids) :]
        assert input_ids[row, tail].tolist() == sample.suffix_ids
        loss_mask[row, tail] = torch.tensor(sample.suffix_supervised)
    return loss_mask


@pytest.mark.parametrize("side", ["left", "right"])
def test_supervision_mask_marks_each_rows_suffix_and_names_a_misplaced_one(side):
    from dflash_hf.data import supervision_mask
    from dflash_hf.data.conversation import RenderedSample

    gen = torch.Generator().manual_seed(0)
    lengths = [9, 4, 12, 1, 7]
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    samples = []
    for row, n in enumerate(lengths):
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        input_ids[row, cols] = torch.randint(1, 100, (n,), generator=gen)
        attention_mask[row, cols] = 1
        k = int(torch.randint(1, n + 1, (), generator=gen))
        flags = torch.rand(k, generator=gen) < 0.6
        samples.append(RenderedSample(f"cut{row}", "", input_ids[row, cols][-k:].tolist(), flags.tolist()))
    got = supervision_mask(input_ids, attention_mask, samples)
    assert torch.equal(got, _per_row_supervision(input_ids, attention_mask, samples)) and got.any()

    wrong = list(samples)
    wrong[2] = RenderedSample("cut2", "", [s + 1 for s in samples[2].suffix_ids], samples[2].suffix_supervised)
    with pytest.raises(ValueError, match="cut 'cut2': the assistant turn tokenizes differently"):
        supervision_mask(input_ids, attention_mask, wrong)
    longer = list(samples)  # a suffix longer than its row's real tokens
    ids = [5] + samples[1].suffix_ids * 2
    longer[1] = RenderedSample("cut1", "", ids, [True] * len(ids))
    with pytest.raises(ValueError, match="cut 'cut1'"):
        supervision_mask(input_ids, attention_mask, longer)
    empty = list(samples)
    empty[3] = RenderedSample("cut3", "", [], [])
    with pytest.raises(ValueError, match="cut 'cut3'"):
        supervision_mask(input_ids, attention_mask, empty)
    assert supervision_mask(input_ids[:0], attention_mask[:0], []).shape == (0, width)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("special", [True, False])
def test_tokenize_padded_equals_the_tokenizers_tensors(asr_target, side, special):
    from dflash_hf.targets.families.base import tokenize_padded

    tok = asr_target[1].tokenizer
    texts = ["yes no", "a much longer text than the first one", "", f"{tiny.IM_START}user\nhi{tiny.IM_END}"]
    got = tokenize_padded(tok, texts, side, special)
    want = tok(texts, padding=True, padding_side=side, add_special_tokens=special, return_tensors="pt")
    for key in ("input_ids", "attention_mask"):
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key])


def test_counts_made_ahead_by_chunk_equal_one_at_a_time_with_reports_in_order(tmp_path, asr_target, monkeypatch):
    """`ValidatedCuts` counts a chunk of cuts with one tokenizer call: every cut keeps the count, the verdict and
    the place of its bad-sample report that it gets validated on its own."""
    from lhotse.utils import fastcopy

    from dflash_hf.data import BadSamples, ConversationRenderer
    from dflash_hf.data.sample_checks import COUNT_CHUNK, NUM_TOKENS_KEY, SampleValidator, ValidatedCuts

    model, processor = asr_target
    family = resolve_family(model.config)
    cuts = list(open_source(tiny.synthesize_speech(tmp_path, COUNT_CHUNK + 6, min_dur=0.3, max_dur=1.6)))
    empty = fastcopy(cuts[3], supervisions=[fastcopy(cuts[3].supervisions[0], text=" ")])
    cuts = [*cuts[:3], empty, *cuts[4:]]

    def validator():
        return SampleValidator(
            ConversationRenderer(processor, family), family, model.config, max_tokens=55, bad=BadSamples(skip=True)
        )

    alone = validator()
    expected = [(c.id, c.custom[NUM_TOKENS_KEY]) for c in map(alone, cuts) if c is not None]
    too_long = [key for key, message in alone.bad.skipped.items() if "max_tokens=55" in message]
    assert 0 < len(too_long) and len(expected) + len(alone.bad.skipped) == len(cuts)

    ahead = validator()
    tokenizer_type, calls = type(processor.tokenizer), []
    original = tokenizer_type.__call__
    monkeypatch.setattr(
        tokenizer_type,
        "__call__",
        lambda self, text, *a, **k: (
            calls.append(len(text) if isinstance(text, list) else 1) or original(self, text, *a, **k)
        ),
    )
    got = [(c.id, c.custom[NUM_TOKENS_KEY]) for c in ValidatedCuts(cuts, ahead)]
    assert got == expected and list(ahead.bad.skipped.items()) == list(alone.bad.skipped.items())
    assert calls == [COUNT_CHUNK - 1, 6]  # one call a chunk, the empty text left out


def test_the_collation_takes_the_conversation_the_validator_rendered(tmp_path, asr_target, monkeypatch):
    """A cut counted by the validator carries its rendered conversation to the collation, which does not render it
    again; a stale text from the data is replaced; a cut whose count was remembered carries the remembered text, or
    none past the memory's cap. The batch is the one the collation renders itself."""
    from lhotse.utils import fastcopy

    from dflash_hf.data import BadSamples, ConversationRenderer, PaddedCollator, cut_to_messages, sample_checks
    from dflash_hf.data.conversation import RENDERED_TEXT_KEY
    from dflash_hf.data.sample_checks import SampleValidator, ValidatedCuts

    model, processor = asr_target
    family = resolve_family(model.config)
    renderer = ConversationRenderer(processor, family)
    cuts = list(open_source(tiny.synthesize_speech(tmp_path, 4)))
    stale = fastcopy(cuts[0], custom={**(cuts[0].custom or {}), RENDERED_TEXT_KEY: "stale"})
    validator = SampleValidator(renderer, family, model.config, max_tokens=None, bad=BadSamples())
    fresh = lambda: [fastcopy(c, custom=dict(c.custom or {})) for c in [stale, *cuts[1:]]]  # noqa: E731
    counted = list(ValidatedCuts(fresh(), validator))
    assert [c.custom[RENDERED_TEXT_KEY][1] for c in counted] == [
        renderer.render_text(cut_to_messages(c, family)) for c in counted
    ]
    again = [validator(c) for c in fresh()]  # a later epoch: counts and texts remembered
    assert [c.custom[RENDERED_TEXT_KEY] for c in again] == [c.custom[RENDERED_TEXT_KEY] for c in counted]
    monkeypatch.setattr(sample_checks, "MAX_REMEMBERED_TEXT_CHARS", 0)
    capped = SampleValidator(renderer, family, model.config, max_tokens=None, bad=BadSamples())
    list(ValidatedCuts(fresh(), capped))
    remembered = [capped(c) for c in fresh()]  # counts remembered, texts not (the cap)
    assert all(RENDERED_TEXT_KEY not in c.custom for c in remembered)

    full_renders = []
    render_text = renderer.render_text
    renderer.render_text = lambda messages, add_generation_prompt=False: (
        full_renders.append(add_generation_prompt is False) or render_text(messages, add_generation_prompt)
    )
    collator = PaddedCollator(processor, model.config, family, renderer, "right")
    batch = collator(counted)
    assert not any(full_renders)
    rendered = collator(remembered)
    assert sum(full_renders) == len(remembered) and set(batch) == set(rendered)
    assert all(torch.equal(batch[k], rendered[k]) for k in batch)
    # a text of other messages (another conversation config) or of another moment (a template that prints the
    # date: the prompt no longer prefixes it) is rendered again
    other = fastcopy(counted[0], custom={**counted[0].custom, RENDERED_TEXT_KEY: (b"0" * 16, "other")})
    dated = fastcopy(
        counted[1],
        custom={
            **counted[1].custom,
            RENDERED_TEXT_KEY: (
                counted[1].custom[RENDERED_TEXT_KEY][0],
                "[Tue] " + counted[1].custom[RENDERED_TEXT_KEY][1],
            ),
        },
    )
    full_renders.clear()
    again = collator([other, dated, *counted[2:]])
    assert sum(full_renders) == 2 and all(torch.equal(batch[k], again[k]) for k in batch)


def test_a_render_that_fails_ahead_is_left_to_the_cuts_own_validation(tmp_path, asr_target):
    """Counting ahead renders cuts before their own checks: one whose render raises is left to its validation, so a
    bad offset is still reported (and skipped) first, as one cut at a time."""
    from dflash_hf.data import BadSamples, ConversationRenderer
    from dflash_hf.data.sample_checks import NUM_TOKENS_KEY, SampleValidator, ValidatedCuts

    model, processor = asr_target
    family = resolve_family(model.config)
    manifest = tiny.synthesize_speech(tmp_path, 3)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    rows[1].update(text="BOOM", offset=50.0)  # past the end of its file: the audio check rejects it
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    renderer = ConversationRenderer(processor, family)
    render_text = renderer.render_text

    def render(messages, add_generation_prompt=False):
        if "BOOM" in repr(messages):
            raise ValueError("the template refused this conversation")
        return render_text(messages, add_generation_prompt)

    renderer.render_text = render
    validator = SampleValidator(renderer, family, model.config, max_tokens=None, bad=BadSamples(skip=True))
    kept = list(ValidatedCuts(list(open_source(manifest)), validator))
    assert [c.id for c in kept] == ["manifest-00000000", "manifest-00000002"] and all(
        c.custom[NUM_TOKENS_KEY] > 0 for c in kept
    )
    (message,) = validator.bad.skipped.values()
    assert "manifest-00000001" in message and "'offset'" in message


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_plain_files_are_read_as_lhotse_reads_them(corpus, fmt):
    """`read_plain_audio` (soundfile, no backend choice) gives lhotse's samples for plain mono cuts, offsets and
    sub-cuts included, and declines cuts it does not reproduce (one with a transform: lhotse reads those)."""
    from dflash_hf.data.collator import load_cut_audio, read_plain_audio

    rng = np.random.default_rng(0)
    cuts = list(open_source(corpus[fmt]))
    pieces = []
    for cut in cuts:
        start = float(rng.uniform(0, cut.duration / 2))
        pieces += [cut, cut.truncate(offset=start, duration=float(rng.uniform(0.05, cut.duration - start)))]
    for cut in pieces:
        got = read_plain_audio(cut)
        want = cut.load_audio()
        assert got is not None and got.dtype == want.dtype and np.array_equal(got, want), cut.id
    louder = cuts[0].perturb_volume(2.0)
    assert read_plain_audio(louder) is None
    assert np.array_equal(load_cut_audio(louder, 16000), louder.load_audio()[0])
    assert np.array_equal(louder.load_audio(), 2 * read_plain_audio(cuts[0]))
