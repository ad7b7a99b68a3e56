"""Audio files are data, never commands: hostile file names (shell metacharacters, quotes, ``$()``, backticks, leading
dashes) in a NeMo manifest, a lhotse cuts file or an HF dataset start no program, in strict and skip mode; a file only
a decoder program could read is a bad sample naming the opt-in flag. Non-finite or absurd samples are bad samples,
raised or skipped and counted, never trained on."""

import json
import os
import subprocess

import numpy as np
import pytest
import soundfile as sf
from lhotse import CutSet, MonoCut, Recording, SupervisionSegment
from lhotse.audio import AudioSource

from dflash_hf.data import BadSampleError, BadSamples, DataSource, build_train_dataloader, load_cut_audio, open_source
from dflash_hf.data.audio_files import ALLOW_PROGRAMS_KEY, MAX_ABS_SAMPLE, SafeAudioBackend

HOSTILE = [
    "y;touch {m};.sph",
    "a$(touch {m}).sph",
    "b`touch {m}`.sph",
    "-c';touch {m};'.opus",
    '--d"; touch {m}; ".sph',
    "e|touch {m}|.mp3",
]


@pytest.fixture
def no_programs(monkeypatch):
    """Any attempt to start a program fails the test (whatever the decoder's way of starting one)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a program was started: {args[:1]}")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "system", refuse)


def _hostile_files(root, readable: bool = True) -> list[str]:
    """The hostile names as files in `root` (real wav content, whatever the suffix, unless not `readable`)."""
    names = []
    for i, pattern in enumerate(HOSTILE):
        name = pattern.format(m=f"MARK{i}")
        if readable:
            sf.write(root / name, np.full(1600, 0.1, np.float32), 16000, format="WAV")
        else:
            (root / name).write_bytes(b"no known audio format" * 20)
        names.append(name)
    return names


def _markers(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("MARK"))


def _nemo(root, names, name="m.json") -> str:
    rows = [{"audio_filepath": n, "duration": 0.1, "text": "hello"} for n in names]
    (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(root / name)


def _cuts_file(root, names) -> str:
    cuts = []
    for i, name in enumerate(names):
        source = AudioSource(type="file", channels=[0], source=str(root / name))
        rec = Recording(id=f"r{i}", sources=[source], sampling_rate=16000, num_samples=1600, duration=0.1)
        sup = SupervisionSegment(id=f"c{i}", recording_id=f"r{i}", start=0, duration=0.1, text="hello")
        cuts.append(MonoCut(id=f"c{i}", start=0, duration=0.1, channel=0, recording=rec, supervisions=[sup]))
    CutSet(cuts).to_file(root / "cuts.jsonl")
    return str(root / "cuts.jsonl")


def test_hostile_names_of_readable_files_are_read_in_process(tmp_path, no_programs):
    names = _hostile_files(tmp_path)
    for path in (_nemo(tmp_path, names), _cuts_file(tmp_path, names)):
        cuts = list(open_source(path))
        assert len(cuts) == len(names)
        for cut in cuts:
            assert load_cut_audio(cut, 16000).shape == (1600,)
    assert _markers(tmp_path) == []


@pytest.mark.parametrize("skip", [False, True])
def test_hostile_names_lhotse_would_hand_to_a_program_are_bad_samples(tmp_path, skip):
    names = _hostile_files(tmp_path, readable=False)
    bad = BadSamples(skip=skip)
    if skip:
        assert list(open_source(_nemo(tmp_path, names), bad)) == []
        assert bad.num_skipped == len(names)
        assert all("--allow_command_audio_sources true" in m for m in bad.skipped.values())
    else:
        with pytest.raises(BadSampleError, match=r"line 1\): field 'audio_filepath'.*allow_command_audio_sources"):
            list(open_source(_nemo(tmp_path, names), bad))
    for cut in open_source(_cuts_file(tmp_path, names)):  # a cuts file names no header to read: refused at read
        with pytest.raises(BadSampleError, match=r"refused by default\. Fix: .*--allow_command_audio_sources true"):
            load_cut_audio(cut, 16000)
    assert _markers(tmp_path) == []


def test_a_data_file_cannot_grant_itself_programs(tmp_path):
    (name,) = _hostile_files(tmp_path, readable=False)[:1]
    row = {"audio_filepath": name, "duration": 0.1, "text": "x", ALLOW_PROGRAMS_KEY: True}
    (tmp_path / "m.json").write_text(json.dumps(row) + "\n")
    with pytest.raises(BadSampleError, match="refused by default"):
        list(open_source(str(tmp_path / "m.json")))


def test_the_opt_in_hands_programs_an_absolute_path_without_a_shell(tmp_path, monkeypatch):
    """With the opt-in, a file libsndfile cannot read goes to audioread as one absolute path (never through lhotse's
    shell decoders, never a name read as an option)."""
    calls = []

    def fake_info(self, path_or_fd, force_opus_sampling_rate=None):
        calls.append(path_or_fd)
        raise RuntimeError("no decoder here")

    from lhotse.audio import backend

    monkeypatch.setattr(backend.AudioreadBackend, "info", fake_info)
    monkeypatch.setattr(backend, "run", lambda *a, **k: pytest.fail("lhotse's shell decoder ran"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "-x;touch MARK.sph").write_bytes(b"junk" * 100)
    with pytest.raises(Exception, match="no decoder here"):
        SafeAudioBackend(allow_programs=True).info("-x;touch MARK.sph")
    assert calls == [str(tmp_path / "-x;touch MARK.sph")]
    assert _markers(tmp_path) == []


def _wav(root, name, values, subtype="FLOAT") -> str:
    sf.write(root / name, np.asarray(values, np.float32), 16000, subtype=subtype)
    return name


@pytest.mark.parametrize(
    "value, problem",
    [(np.nan, "non-finite"), (np.inf, "non-finite"), (-np.inf, "non-finite"), (1e30, "magnitude 1e\\+30")],
)
def test_non_finite_or_absurd_audio_is_a_bad_sample(tmp_path, value, problem):
    samples = np.full(1600, 0.1, np.float32)
    samples[800] = value
    path = _nemo(tmp_path, [_wav(tmp_path, "bad.wav", samples)])
    (cut,) = open_source(path)
    with pytest.raises(
        BadSampleError, match=f"'m-00000000' .*line 1\\): field 'audio_filepath': the audio .*{problem}"
    ):
        load_cut_audio(cut, 16000)


def test_loud_but_plausible_float_audio_is_kept(tmp_path):
    samples = np.full(1600, MAX_ABS_SAMPLE / 2, np.float32)
    (cut,) = open_source(_nemo(tmp_path, [_wav(tmp_path, "loud.wav", samples)]))
    assert np.allclose(load_cut_audio(cut, 16000), MAX_ABS_SAMPLE / 2)


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])  # a worker process: 5 s on 2 cores
def test_bad_audio_is_skipped_and_counted_by_the_loader(tmp_path, asr_target, workers):
    """Found when the collator reads it (in a worker process or not): the row leaves its batch, the loader counts
    it, a batch left empty is not handed out; strict mode raises naming the row."""
    model, processor = asr_target
    good = [_wav(tmp_path, f"g{i}.wav", np.full(16000, 0.1)) for i in range(3)]
    nan = np.full(16000, 0.1)
    nan[5] = np.nan
    rows = good + [_wav(tmp_path, "nan.wav", nan)]
    path = _nemo(tmp_path, rows)
    kw = dict(max_tokens=400, max_batch_size=1, shuffle=False, num_workers=workers)
    with pytest.raises(BadSampleError, match="line 4\\): field 'audio_filepath'.*non-finite.*--skip_bad_samples"):
        list(build_train_dataloader(path, processor, model.config, **kw))
    loader = build_train_dataloader(path, processor, model.config, skip_bad_samples=True, **kw)
    batches = list(loader)
    assert len(batches) == 3 and all(torch_finite(b) for b in batches)
    assert loader.bad_samples.num_skipped == 1
    assert "nan.wav" not in json.dumps([str(b.keys()) for b in batches])
    assert "line 4" in loader.bad_samples.summary()
    assert loader.batches_consumed == 4  # the empty batch counts in the position (resume replays it the same)


def torch_finite(batch) -> bool:
    return all(v.isfinite().all() for v in batch.values() if hasattr(v, "is_floating_point") and v.is_floating_point())


def test_hf_dataset_audio_is_read_without_programs(tmp_path, no_programs):
    datasets = pytest.importorskip("datasets")
    names = _hostile_files(tmp_path)
    ds = datasets.Dataset.from_dict({"audio": [str(tmp_path / n) for n in names], "text": ["x"] * len(names)})
    cuts = list(open_source(DataSource(hf_dataset=ds)))
    assert [load_cut_audio(c, 16000).shape for c in cuts] == [(1600,)] * len(names)
    assert _markers(tmp_path) == []


def test_data_whose_every_sample_turns_out_bad_when_read_is_an_error_not_an_endless_loop(tmp_path, asr_target):
    model, processor = asr_target
    nan = np.full(16000, np.nan)
    path = _nemo(tmp_path, [_wav(tmp_path, f"n{i}.wav", nan) for i in range(2)])
    loader = build_train_dataloader(path, processor, model.config, max_tokens=400, skip_bad_samples=True)
    with pytest.raises(ValueError, match="epoch 0 of the training data gave no batch .*all samples skipped"):
        next(loader.epochs())
    assert loader.bad_samples.num_skipped == 2
