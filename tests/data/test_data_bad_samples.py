import json

import numpy as np
import pytest
import soundfile as sf

from dflash_hf.data import BadSampleError, build_train_dataloader, load_cut_audio, open_source


@pytest.fixture()
def good(tmp_path):
    """A manifest of 3 good 1 s utterances; returns (dir, list of lines)."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(3):
        sf.write(tmp_path / f"g{i}.wav", (0.1 * rng.standard_normal(16000)).astype(np.float32), 16000)
        lines.append({"audio_filepath": f"g{i}.wav", "duration": 1.0, "text": f"yes {i}"})
    return tmp_path, lines


def _write(root, lines, bad_line):
    path = root / "m.json"
    path.write_text("\n".join(json.dumps(x) if isinstance(x, dict) else x for x in [bad_line] + lines) + "\n")
    return path


def _check(asr_target, root, lines, bad_line, pattern, **kw):
    """Strict mode raises a message matching ``pattern`` (cut id + field + fix) before any batch is made;
    skip mode drops exactly the bad line, counts it and names it."""
    model, processor = asr_target
    manifest = _write(root, lines, bad_line)
    with pytest.raises(BadSampleError, match=pattern) as info:
        build_train_dataloader(manifest, processor, model.config, max_tokens=400, **kw)
    row = f"'m-00000000' ({manifest} line 1)"  # cut id and source row
    assert f"bad sample {row}: field" in str(info.value) and "Fix:" in str(info.value)
    assert "--skip_bad_samples true" in str(info.value)
    loader = build_train_dataloader(manifest, processor, model.config, max_tokens=400, skip_bad_samples=True, **kw)
    assert sum(len(b["input_ids"]) for b in loader) == len(lines)
    assert loader.bad_samples.num_skipped == 1 and list(loader.bad_samples.skipped) == [row]
    assert f"skipped 1 bad samples: {row}" in loader.bad_samples.summary()


def test_missing_audio(asr_target, good):
    root, lines = good
    _check(
        asr_target,
        root,
        lines,
        {"audio_filepath": "nope.wav", "duration": 1.0, "text": "x"},
        r"'audio_filepath'.*does not exist",
    )


def test_unreadable_audio(asr_target, good):
    root, lines = good
    (root / "junk.wav").write_bytes(b"this is not audio at all" * 10)
    _check(
        asr_target,
        root,
        lines,
        {"audio_filepath": "junk.wav", "duration": 1.0, "text": "x"},
        r"'audio_filepath'.*unreadable",
    )


def test_empty_text_and_missing_text(asr_target, good):
    root, lines = good
    _check(asr_target, root, lines, {"audio_filepath": "g0.wav", "duration": 1.0, "text": ""}, r"'text'.*empty")
    _check(asr_target, root, lines, {"audio_filepath": "g0.wav", "duration": 1.0}, r"'text'.*missing")


def test_invalid_json_line(asr_target, good):
    root, lines = good
    _check(asr_target, root, lines, "{not json", r"'<line>'.*not valid JSON")


def test_duration_and_offset_outside_file(asr_target, good):
    root, lines = good
    _check(
        asr_target,
        root,
        lines,
        {"audio_filepath": "g0.wav", "duration": 1.5, "text": "x"},
        r"'duration'.*runs past the end",
    )
    _check(
        asr_target,
        root,
        lines,
        {"audio_filepath": "g0.wav", "offset": 0.8, "duration": 0.5, "text": "x"},
        r"'duration'.*runs past the end",
    )
    _check(
        asr_target,
        root,
        lines,
        {"audio_filepath": "g0.wav", "offset": 2.0, "duration": 0.5, "text": "x"},
        r"'offset'.*outside",
    )


def test_rounded_duration_within_tolerance_is_clipped(asr_target, good):
    root, lines = good
    model, processor = asr_target
    manifest = _write(root, lines, {"audio_filepath": "g0.wav", "duration": 1.02, "text": "x"})
    loader = build_train_dataloader(manifest, processor, model.config, max_tokens=400, max_batch_size=1, shuffle=False)
    assert sum(len(b["input_ids"]) for b in loader) == 4 and loader.bad_samples.num_skipped == 0
    from dflash_hf.data.bad_samples import BadSamples
    from dflash_hf.data.conversation import ConversationRenderer
    from dflash_hf.data.sample_checks import SampleValidator
    from dflash_hf.targets.families.registry import resolve_family

    family = resolve_family(model.config)
    validator = SampleValidator(
        ConversationRenderer(processor, family), family, model.config, max_tokens=None, bad=BadSamples()
    )
    clipped = [validator.check_audio(c) for c in open_source(manifest)]
    assert clipped[0].duration == 1.0 and [c.id for c in clipped] == [c.id for c in open_source(manifest)]  # ids kept


def test_sample_rate_mismatch_refused_or_resampled(asr_target, good):
    root, lines = good
    t = np.arange(8000) / 8000
    sf.write(root / "low.wav", (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 8000)
    bad_line = {"audio_filepath": "low.wav", "duration": 1.0, "text": "x"}
    _check(asr_target, root, lines, bad_line, r"'sampling_rate'.*8000 Hz", resample_audio=False)
    cut = next(iter(open_source(_write(root, lines, bad_line))))
    audio = load_cut_audio(cut, 16000)
    assert audio.shape == (16000,)
    spectrum = np.abs(np.fft.rfft(audio))
    assert abs(np.argmax(spectrum) - 440) <= 1  # 1 Hz bins over 1 s: the tone survives resampling


def test_sample_longer_than_budget(asr_target, good):
    root, lines = good
    sf.write(root / "long.wav", np.zeros(16000 * 40, dtype=np.float32), 16000)
    _check(
        asr_target,
        root,
        lines,
        {"audio_filepath": "long.wav", "duration": 40.0, "text": "x"},
        r"'duration'.*decoder tokens.*max_tokens=400",
    )


def test_decode_failure_after_header_names_the_cut(tmp_path):
    sf.write(tmp_path / "a.wav", np.zeros(16000, dtype=np.float32), 16000)
    (tmp_path / "m.json").write_text(json.dumps({"audio_filepath": "a.wav", "duration": 1.0, "text": "x"}))
    cut = next(iter(open_source(tmp_path / "m.json")))
    (tmp_path / "a.wav").write_bytes(b"gone")
    with pytest.raises(BadSampleError, match=r"'m-00000000'.*'audio_filepath'.*decoding failed"):
        load_cut_audio(cut, 16000)


def test_text_only_cuts_may_have_zero_duration_but_cuts_with_audio_may_not(tmp_path):
    from lhotse import CutSet, MonoCut, Recording
    from lhotse.supervision import SupervisionSegment

    from dflash_hf.data.bad_samples import BadSampleError
    from dflash_hf.data.lhotse_cuts import LhotseCuts

    def cut(cid, recording=None):
        sup = SupervisionSegment(id=cid, recording_id=cid, start=0.0, duration=0.0, text="hello")
        return MonoCut(id=cid, start=0.0, duration=0.0, channel=0, supervisions=[sup], recording=recording)

    text = tmp_path / "text.jsonl.gz"
    CutSet.from_cuts([cut("t0")]).to_file(text)
    assert [c.id for c in LhotseCuts(text)] == ["t0"]  # a text-only cut has no audio to time
    audio = tmp_path / "audio.jsonl.gz"
    rec = Recording(id="a0", sources=[], sampling_rate=16000, num_samples=16000, duration=1.0)
    CutSet.from_cuts([cut("a0", rec)]).to_file(audio)
    with pytest.raises(BadSampleError, match="'duration': is 0.0"):
        LhotseCuts(audio).check()
