"""Bad manifests, table-driven: every malformed row is a BadSampleError naming file, line, field and fix when
the source is opened (before any batch), or one counted skip with --skip_bad_samples true; gzipped inputs;
lhotse cuts whose audio comes from a command or a URL are refused unless allowed."""

import gzip
import json

import numpy as np
import pytest
import soundfile as sf
from lhotse import MonoCut, Recording, SupervisionSegment

from dflash_hf.data import BadSampleError, BadSamples, DataSource, build_train_dataloader, load_cut_audio, open_source
from dflash_hf.testing import tiny
from dflash_hf.training.training_args import DFlashDataArguments

GOOD = [{"audio_filepath": f"g{i}.wav", "duration": 1.0, "text": f"yes {i}"} for i in range(3)]
LINE = {"audio_filepath": "g0.wav", "duration": 1.0, "text": "x"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Three good 1 s wavs, an empty, a header-only and a stereo wav, and a directory."""
    root = tmp_path_factory.mktemp("bad_data")
    rng = np.random.default_rng(0)
    for i in range(3):
        sf.write(root / f"g{i}.wav", (0.1 * rng.standard_normal(16000)).astype(np.float32), 16000)
    (root / "empty.wav").write_bytes(b"")
    sf.write(root / "header_only.wav", np.zeros(0, dtype=np.float32), 16000)
    (root / "adir.wav").mkdir()
    sf.write(root / "stereo.wav", np.zeros((16000, 2), dtype=np.float32), 16000)
    return root


def _manifest(root, name: str, bad: bytes, good=GOOD) -> str:
    """Good lines then ``bad`` as the last line (line len(good) + 1)."""
    path = root / name
    path.write_bytes(b"".join(json.dumps(x).encode() + b"\n" for x in good) + bad + b"\n")
    return str(path)


def _row(value) -> bytes:
    return json.dumps(value).encode()


# (bad last line, field named, words of the problem)
NEMO_ROWS = [
    (_row([1, 2]), "<line>", "JSON array"),
    (_row(5), "<line>", "JSON number"),
    (_row("a string"), "<line>", "JSON string"),
    (b"null", "<line>", "JSON null"),
    (b"{not json", "<line>", "not valid JSON"),
    (b'{"audio_filepath": "g0.wav", "text": "\xff\xfe"}', "<line>", "not UTF-8"),
    (_row({**LINE, "duration": "1.0"}), "duration", "JSON string '1.0', not a number"),
    (_row({**LINE, "duration": True}), "duration", "JSON boolean"),
    (_row({**LINE, "duration": float("nan")}), "duration", "NaN"),
    (_row({**LINE, "duration": float("inf")}), "duration", "not a finite number"),
    (_row({**LINE, "duration": -1.0}), "duration", "must be > 0"),
    (_row({**LINE, "duration": 0}), "duration", "must be > 0"),
    (_row({**LINE, "offset": float("nan")}), "offset", "NaN"),
    (_row({**LINE, "offset": -0.5}), "offset", "must be >= 0"),
    (_row({**LINE, "offset": "0"}), "offset", "JSON string"),
    (_row({**LINE, "audio_filepath": 5}), "audio_filepath", "JSON number 5, not a file path"),
    (_row({**LINE, "audio_filepath": None}), "audio_filepath", "JSON null"),
    (_row({**LINE, "audio_filepath": ""}), "audio_filepath", "not a file path"),
    (_row({"duration": 1.0, "text": "x"}), "audio_filepath", "missing"),
    (_row({**LINE, "text": 5}), "text", "JSON number 5, not a string"),
    (_row({**LINE, "text": ["a"]}), "text", "JSON array"),
    (_row({**LINE, "lang": 5}), "lang", "not a string"),
    (_row({**LINE, "id": {"a": 1}}), "id", "JSON object"),
    (_row({**LINE, "audio_filepath": "adir.wav"}), "audio_filepath", "is a directory"),
    (_row({**LINE, "audio_filepath": "empty.wav"}), "audio_filepath", "is empty (0 bytes)"),
    (_row({**LINE, "text": "word " * 20}), "text", "has 99 characters for 1 s of audio (99 per second, more than"),
]


@pytest.mark.parametrize(("bad", "field", "problem"), NEMO_ROWS, ids=[f"{f}:{p}" for _, f, p in NEMO_ROWS])
def test_bad_nemo_row_is_named_at_open_or_skipped_and_counted(root, bad, field, problem):
    path = _manifest(root, "m.json", bad)
    with pytest.raises(BadSampleError) as info:
        list(open_source(path))  # the row-level ones already raise inside open_source (the up-front scan)
    message = str(info.value)
    assert f"({path} line 4): field {field!r}: " in message and problem in message, message
    assert "Fix: " in message and "--skip_bad_samples true" in message
    bad_samples = BadSamples(skip=True)
    cuts = open_source(path, bad_samples)
    assert [c.id for c in cuts] == ["m-00000000", "m-00000001", "m-00000002"]
    assert [c.id for c in cuts] == ["m-00000000", "m-00000001", "m-00000002"]  # a second epoch: same count
    assert bad_samples.num_skipped == 1 and f"line 4): field {field!r}" in next(iter(bad_samples.skipped.values()))


def test_malformed_rows_are_refused_before_training_even_past_the_bucket_estimate(root, asr_target):
    """The up-front scan sees every row: a bad last row fails building the loader although the bucket estimate
    reads only the first cut and packing reads none."""
    model, processor = asr_target
    path = _manifest(root, "late.json", _row({**LINE, "text": 7}))
    for kw in ({"num_cuts_for_bins_estimate": 1}, {"packing": True}):
        with pytest.raises(BadSampleError, match=r"late.json line 4\): field 'text'"):
            build_train_dataloader(path, processor, model.config, max_tokens=400, **kw)


# cut-level problems found by the validator (audio header, token budget, conversation fields)
CUT_ROWS = [
    (_row({**LINE, "audio_filepath": "header_only.wav"}), "audio_filepath", "no samples (an empty or header-only"),
    (_row({**LINE, "audio_filepath": "stereo.wav"}), "audio_filepath", "2 channels, targets take mono"),
    # without a duration (the file's 1 s), so the validator counts the tokens: the budget is named first
    (_row({"audio_filepath": "g0.wav", "text": "word " * 400}), "text", "rendered text tokens"),
    (_row({"audio_filepath": "g0.wav", "text": "word " * 20}), "text", "has 99 characters for 1 s of audio"),
    (_row({**LINE, "context": 5}), "context", "is not a string (int 5)"),
    (_row({**LINE, "system_prompt": ["a"]}), "system_prompt", "not a string"),
]


@pytest.mark.parametrize(("bad", "field", "problem"), CUT_ROWS, ids=[f for _, f, _ in CUT_ROWS])
def test_bad_cut_names_the_right_field(root, asr_target, bad, field, problem):
    model, processor = asr_target
    path = _manifest(root, "c.json", bad)
    with pytest.raises(BadSampleError) as info:
        build_train_dataloader(path, processor, model.config, max_tokens=400)
    message = str(info.value)
    assert f"'c-00000003' ({path} line 4): field {field!r}: " in message and problem in message, message
    loader = build_train_dataloader(path, processor, model.config, max_tokens=400, skip_bad_samples=True)
    assert loader.bad_samples.num_skipped == 1  # the bucket estimate read every cut


def test_two_bad_rows_sharing_an_id_count_twice(root):
    bad = b"\n".join(_row({**LINE, "id": "dup", "audio_filepath": f"missing{i}.wav"}) for i in range(2))
    path = _manifest(root, "dup.json", bad)
    bad_samples = BadSamples(skip=True)
    assert len(list(open_source(path, bad_samples))) == 3
    assert bad_samples.num_skipped == 2
    assert sorted(bad_samples.skipped) == [f"'dup' ({path} line 4)", f"'dup' ({path} line 5)"]


@pytest.mark.parametrize("suffix", [".json.gz", ".jsonl.gz"])
def test_gzipped_nemo_manifest(root, suffix):
    path = root / f"z{suffix}"
    path.write_bytes(gzip.compress(b"".join(_row(x) + b"\n" for x in GOOD)))
    cuts = list(open_source(path))
    assert [c.id for c in cuts] == ["z-00000000", "z-00000001", "z-00000002"]
    assert cuts[2].supervisions[0].text == "yes 2"
    truncated = root / f"t{suffix}"
    truncated.write_bytes(path.read_bytes()[:-6])
    with pytest.raises(ValueError, match=r"t\.json.*\.gz' cannot be read after line .*truncated or corrupt"):
        list(open_source(truncated))


def test_byte_order_mark_and_blank_lines_are_not_bad_rows(root):
    path = root / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n\n".join(_row(x) for x in GOOD) + b"\n")
    assert [c.id for c in open_source(path)] == ["bom-00000000", "bom-00000002", "bom-00000004"]  # index = line - 1


def _cut_dict(root, i: int, **fields) -> dict:
    recording = Recording.from_file(root / f"g{i}.wav", recording_id=f"r{i}")
    cut = MonoCut(
        f"c{i}",
        0.0,
        1.0,
        0,
        recording=recording,
        supervisions=[SupervisionSegment(f"c{i}", f"r{i}", 0.0, 1.0, text=f"yes {i}")],
    )
    return cut.to_dict() | fields


def _cuts_file(root, name: str, bad: bytes, gz: bool = False) -> str:
    data = b"".join(_row(_cut_dict(root, i)) + b"\n" for i in range(3)) + bad + b"\n"
    path = root / name
    path.write_bytes(gzip.compress(data) if gz else data)
    return str(path)


def test_bad_lhotse_cut_lines(root):
    base = json.dumps(_cut_dict(root, 0, id="bad"))
    no_duration = {k: v for k, v in json.loads(base).items() if k != "duration"}
    cases = [
        (b"{not json", "<line>", "not valid JSON"),
        (_row([1]), "<line>", "JSON array"),
        (b'{"id": "\xff"}', "<line>", "not UTF-8"),
        (_row({**json.loads(base), "type": "MixedCut"}), "type", 'only "MonoCut"'),
        (_row(no_duration), "<cut>", "not a valid lhotse MonoCut"),
        (_row({**json.loads(base), "start": float("nan")}), "start", "NaN"),
        (_row({**json.loads(base), "duration": "1"}), "duration", "JSON string"),
    ]
    for bad, field, problem in cases:
        path = _cuts_file(root, "cuts.jsonl.gz", bad, gz=True)
        with pytest.raises(BadSampleError) as info:
            open_source(path)
        assert f"({path} line 4): field {field!r}: " in str(info.value) and problem in str(info.value)
        bad_samples = BadSamples(skip=True)
        assert [c.id for c in open_source(path, bad_samples)] == ["c0", "c1", "c2"] and bad_samples.num_skipped == 1


def test_lhotse_supervision_text_that_is_not_a_string(root, asr_target):
    model, processor = asr_target
    cut = _cut_dict(root, 0, id="bad")
    cut["supervisions"][0]["text"] = 12
    path = _cuts_file(root, "text.jsonl", _row(cut))
    with pytest.raises(BadSampleError, match=r"'bad' \(.*text.jsonl line 4\): field 'text': is not a string \(int 12"):
        build_train_dataloader(path, processor, model.config, max_tokens=400)
    loader = build_train_dataloader(path, processor, model.config, max_tokens=400, skip_bad_samples=True)
    assert list(loader.bad_samples.skipped) == [f"'bad' ({path} line 4)"]


def _gated(root, kind: str, source: str) -> dict:
    cut = _cut_dict(root, 0, id="gated")
    cut["recording"]["sources"] = [{"type": kind, "channels": [0], "source": source}]
    return cut


def test_command_audio_source_is_refused_unless_allowed(root, tmp_path):
    marker = tmp_path / "ran"
    path = _cuts_file(root, "cmd.jsonl", _row(_gated(root, "command", f"touch {marker}")))
    for bad in (None, BadSamples(skip=True)):  # a security refusal is never a skip
        with pytest.raises(
            BadSampleError,
            match=r"line 4\): field 'recording.sources\[0\].type': is 'command'.*"
            r"--allow_command_audio_sources true",
        ):
            open_source(path, bad)
    assert not marker.exists()
    # allowed: the command is what reads the audio
    allowed = _cuts_file(root, "cmd_ok.jsonl", _row(_gated(root, "command", f"cat {root / 'g1.wav'}")))
    cuts = list(open_source(DataSource(path=allowed, allow_command_audio_sources=True)))
    reference = load_cut_audio(cuts[1], 16000)
    np.testing.assert_array_equal(load_cut_audio(cuts[3], 16000), reference)


def test_url_audio_source_is_refused_unless_allowed(root):
    path = _cuts_file(root, "url.jsonl", _row(_gated(root, "url", "http://127.0.0.1:9/a.wav")))
    with pytest.raises(BadSampleError, match=r"'recording.sources\[0\].type': is 'url'.*--allow_url_audio_sources"):
        open_source(path)
    assert len(list(open_source(DataSource(path=path, allow_url_audio_sources=True)))) == 4  # not fetched here
    with pytest.raises(BadSampleError, match="is 'url'"):  # the command flag does not allow URLs
        open_source(DataSource(path=path, allow_command_audio_sources=True))


def test_cli_flags_reach_every_source(root):
    path = _manifest(root, "flags.json", _row(LINE))
    args = DFlashDataArguments(train_data=[path], eval_data=[f"dev={path}"], allow_command_audio_sources=True)
    (train,), dev = args.train_sources(), args.eval_sources()["dev"]
    assert train.allow_command_audio_sources and dev.allow_command_audio_sources
    assert not train.allow_url_audio_sources and not dev.allow_url_audio_sources


def test_validation_set_skips_are_reported_in_the_eval_metrics(root, tmp_path):
    from utils import make_args

    from dflash_hf import DFlashTrainer

    tok = tiny.build_tokenizer()
    model, processor = tiny.build_qwen3_asr_target(tok, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)
    dev = _manifest(root, "dev.json", _row({**LINE, "audio_filepath": "missing.wav"}))
    clean = root / "clean.json"
    clean.write_text("".join(json.dumps(x) + "\n" for x in GOOD))
    data_args = DFlashDataArguments(max_tokens=600, skip_bad_samples=True, eval_data=[f"dev={dev}", f"clean={clean}"])
    trainer = DFlashTrainer(
        args=make_args(tmp_path, mask_token_id=262),
        target=model,
        processor=processor,
        data_args=data_args,
        eval_dataset=data_args.eval_sources(),
    )
    metrics = trainer.evaluate()
    assert metrics["eval_dev_skipped_samples"] == 1 and metrics["eval_clean_skipped_samples"] == 0
    assert np.isfinite(metrics["eval_dev_loss"])


def test_hf_dataset_rows_are_named_by_row(root):
    from datasets import Dataset

    ds = Dataset.from_dict(
        {"audio": [str(root / "g0.wav"), str(root / "adir.wav"), str(root / "nope.wav")], "text": ["a", "b", "c"]}
    )
    with pytest.raises(BadSampleError) as info:
        list(open_source(DataSource(hf_dataset=ds, path="hf")))
    assert "'hf-00000001' (hf dataset 'hf' row 1): field 'audio': audio path" in str(info.value)
    assert "is a directory" in str(info.value) and "unreadable" not in str(info.value)
    bad_samples = BadSamples(skip=True)
    assert [c.id for c in open_source(DataSource(hf_dataset=ds, path="hf"), bad_samples)] == ["hf-00000000"]
    assert sorted(bad_samples.skipped) == [f"'hf-0000000{i}' (hf dataset 'hf' row {i})" for i in (1, 2)]


def test_dflash_train_names_a_bad_row_before_the_target_loads(root, tmp_path, monkeypatch):
    """Strict mode: `dflash-train` reads the data's rows before it loads the (expensive) target."""
    from dflash_hf.cli import train as cli_train
    from dflash_hf.targets import builder as target_module
    from dflash_hf.training.training_args import DFlashTrainingArguments

    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the data's rows were checked")

    monkeypatch.setattr(target_module, "load_target", no_load)
    manifest = _manifest(root, "train_bad_last.json", _row({**LINE, "duration": float("nan")}))
    args = DFlashTrainingArguments(
        output_dir=str(tmp_path), target_name_or_path=str(root), mask_token_id=5, use_cpu=True, max_steps=1
    )
    with pytest.raises(BadSampleError, match=r"train_bad_last.json line 4\): field 'duration'"):
        cli_train.train(args, DFlashDataArguments(train_data=[manifest]))
