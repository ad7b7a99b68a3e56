import json
import os
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
import yaml

from dflash_hf.cli.generate_labels import main, make_parser
from dflash_hf.data import BadSampleError, open_source
from dflash_hf.data.label_rows import partial_path
from dflash_hf.testing import tiny


def _greedy_one(model, processor, line, root, max_new_tokens):
    """The target's own greedy output for one utterance, unbatched."""
    audio, sr = sf.read(root / line["audio_filepath"], dtype="float32")
    messages = [{"role": "user", "content": [{"type": "audio"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], audio=[audio], sampling_rate=sr)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def _greedy_ids(model, processor, line, max_new_tokens) -> list[int]:
    """The target's own greedy new ids for one utterance (absolute audio path), unbatched."""
    audio, sr = sf.read(line["audio_filepath"], dtype="float32")
    messages = [{"role": "user", "content": [{"type": "audio"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], audio=[audio], sampling_rate=sr)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.slow  # 5 s on 2 busy cores
def test_generated_labels_equal_target_greedy_and_resume(tmp_path):
    kw = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=1)
    model_dir = tiny.save_tiny_target(tmp_path / "target", "qwen3_asr", **kw)
    manifest = tiny.synthesize_speech(tmp_path / "data", 4, seed=2, min_dur=0.5, max_dur=1.5)
    lines = [json.loads(x) for x in manifest.read_text().splitlines()]
    lines[1]["offset"] = 0.1
    lines[1]["duration"] = round(lines[1]["duration"] - 0.2, 2)
    lines[2]["speaker"] = "spk7"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "labels.json"
    config = tmp_path / "gen.yaml"
    config.write_text(
        yaml.safe_dump({"model": str(model_dir), "manifest": str(manifest), "batch_size": 2, "max_new_tokens": 4})
    )
    assert main(["--config", str(config), "--output", str(out)]) == 0
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["id"] for g in got] == [f"manifest-{i:08d}" for i in range(4)]

    model, processor = tiny.build_qwen3_asr_target(**kw)
    for line, g in zip(lines, got):
        assert g["reference_text"] == line["text"]
        same = [k for k in line if k not in ("text", "audio_filepath")]
        assert {k: g[k] for k in same} == {k: line[k] for k in same}
        # relative audio paths are re-expressed relative to the output manifest and point at the same file
        assert (out.parent / g["audio_filepath"]).resolve() == (manifest.parent / line["audio_filepath"]).resolve()
        if "offset" not in line:
            assert g["text"] == _greedy_one(model, processor, line, manifest.parent, 4)
    assert any(g["text"] != line["text"] for g, line in zip(got, lines))
    # the new manifest reads back as cuts whose supervision is the generated text (same audio window)
    cuts = list(open_source(out))
    assert [c.supervisions[0].text for c in cuts] == [g["text"] for g in got]
    assert cuts[1].start == 0.1 and cuts[2].custom["speaker"] == "spk7"

    # resume: keep two finished lines plus a torn one; only the rest is generated again
    kept = [dict(g, text=f"KEPT{i}") for i, g in enumerate(got[:2])]
    out.write_text("".join(json.dumps(k) + "\n" for k in kept) + '{"audio_filepath": "tor')
    assert main(["--config", str(config), "--output", str(out), "--reference_key", "orig"]) == 0
    resumed = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["text"] for r in resumed[:2]] == ["KEPT0", "KEPT1"]
    assert [r["text"] for r in resumed[2:]] == [g["text"] for g in got[2:]]
    assert [r["orig"] for r in resumed[2:]] == [x["text"] for x in lines[2:]]


def test_parser_fields(tmp_path):
    (tmp_path / "a.json").write_text('{"audio_filepath": "x.wav", "text": ""}\n')
    with pytest.raises(ValueError, match="field 'model': .* has no config transformers can read"):
        make_parser().parse_args_into_dataclasses(
            ["--model", str(tmp_path), "--manifest", str(tmp_path / "a.json"), "--output", "b"]
        )
    tiny.build_qwen3_asr_target(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)[0].config.save_pretrained(
        tmp_path
    )
    argv = ["--model", str(tmp_path), "--manifest", str(tmp_path / "a.json"), "--output", "b"]
    (args,) = make_parser().parse_args_into_dataclasses(argv)
    assert args.reference_key == "reference_text" and args.batch_size == 8 and args.dtype == "float32"


def test_missing_model_or_manifest_named_before_loading(tmp_path):
    (tmp_path / "a.json").write_text("")
    missing = str(tmp_path / "no_model")
    with pytest.raises(FileNotFoundError, match=r"model=.*no_model: the directory does not exist"):
        make_parser().parse_args_into_dataclasses(
            ["--model", missing, "--manifest", str(tmp_path / "a.json"), "--output", "b"]
        )
    with pytest.raises(FileNotFoundError, match=r"field 'manifest': .*nope.json' is not a file"):
        make_parser().parse_args_into_dataclasses(
            ["--model", str(tmp_path), "--manifest", str(tmp_path / "nope.json"), "--output", "b"]
        )


def test_single_placeholder_row_labels_equal_the_processor_rows(tmp_path):
    """`--family qwen2_audio_single_placeholder` (the model expands the audio placeholder) decodes without
    transformers' `generate`, which cannot run that row's merge; the labels equal the processor-side row's."""
    from targets.test_families import save_qwen2_audio

    save_qwen2_audio(tmp_path / "target")
    manifest = tiny.synthesize_speech(tmp_path / "data", 3, seed=2, min_dur=0.5, max_dur=1.0)
    texts = {}
    for family in ("qwen2_audio", "qwen2_audio_single_placeholder"):
        out = tmp_path / f"{family}.json"
        assert (
            main(
                [
                    "--model",
                    str(tmp_path / "target"),
                    "--manifest",
                    str(manifest),
                    "--output",
                    str(out),
                    "--family",
                    family,
                    "--batch_size",
                    "2",
                    "--max_new_tokens",
                    "5",
                    "--prompt",
                    "Transcribe.",
                ]
            )
            == 0
        )
        texts[family] = [json.loads(x)["text"] for x in out.read_text().splitlines()]
    assert len(texts["qwen2_audio"]) == 3 and all(texts["qwen2_audio"])
    assert texts["qwen2_audio_single_placeholder"] == texts["qwen2_audio"]


@pytest.mark.slow  # 8 s on 2 busy cores
def test_prefetching_the_next_batch_changes_nothing_written(tmp_path):
    """With the next batch read and encoded in a background thread the output is the same file, and a bad sample in
    a later batch still stops the run after the batches before it were written (to the output's .partial file)."""
    from dflash_hf.data.bad_samples import BadSampleError

    kw = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=1)
    model_dir = tiny.save_tiny_target(tmp_path / "target", "qwen3_asr", **kw)
    manifest = tiny.synthesize_speech(tmp_path / "data", 7, seed=3, min_dur=0.5, max_dur=1.5)
    outputs = {}
    for prefetch in ("false", "true"):
        outputs[prefetch] = tmp_path / f"labels_{prefetch}.json"
        assert (
            main(
                [
                    "--model",
                    str(model_dir),
                    "--manifest",
                    str(manifest),
                    "--output",
                    str(outputs[prefetch]),
                    "--batch_size",
                    "2",
                    "--max_new_tokens",
                    "4",
                    "--prefetch",
                    prefetch,
                ]
            )
            == 0
        )
    assert outputs["true"].read_text() == outputs["false"].read_text()
    assert len(outputs["true"].read_text().splitlines()) == 7

    lines = manifest.read_text().splitlines()
    broken = json.loads(lines[4])
    broken["audio_filepath"] = "audio/missing.wav"
    lines[4] = json.dumps(broken)
    manifest.write_text("\n".join(lines) + "\n")
    written = {}
    for prefetch in ("false", "true"):
        out = tmp_path / f"partial_{prefetch}.json"
        with pytest.raises(BadSampleError, match="missing.wav"):
            main(
                [
                    "--model",
                    str(model_dir),
                    "--manifest",
                    str(manifest),
                    "--output",
                    str(out),
                    "--batch_size",
                    "2",
                    "--max_new_tokens",
                    "4",
                    "--prefetch",
                    prefetch,
                ]
            )
        assert not out.exists()  # the output appears only once complete; the rows so far wait in its .partial
        written[prefetch] = partial_path(out).read_text()
    assert written["true"] == written["false"] == "".join(outputs["true"].read_text().splitlines(True)[:4])


def test_shards_concatenated_in_order_equal_the_whole_run(tmp_path):
    kw = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=1)
    model_dir = tiny.save_tiny_target(tmp_path / "target", "qwen3_asr", **kw)
    manifest = tiny.synthesize_speech(tmp_path / "data", 7, seed=4, min_dur=0.5, max_dur=1.2)
    common = ["--model", str(model_dir), "--manifest", str(manifest), "--batch_size", "2", "--max_new_tokens", "3"]
    assert main([*common, "--output", str(tmp_path / "whole.json")]) == 0
    parts = []
    for k in range(3):  # 7 lines in parts of 3, 3, 1
        parts.append(tmp_path / f"part{k}.json")
        assert main([*common, "--output", str(parts[-1]), "--num_shards", "3", "--shard_index", str(k)]) == 0
    assert [len(p.read_text().splitlines()) for p in parts] == [3, 3, 1]
    assert "".join(p.read_text() for p in parts) == (tmp_path / "whole.json").read_text()
    for bad, field in (
        (["--num_shards", "2", "--shard_index", "2"], "shard_index"),
        (["--num_shards", "0"], "num_shards"),
        (["--batch_size", "0"], "batch_size"),
        (["--dtype", "fp16"], "dtype"),
    ):
        with pytest.raises(ValueError, match=f"field '{field}'"):
            main([*common, "--output", str(tmp_path / "never.json"), *bad])
    assert not (tmp_path / "never.json").exists()


def _gen(model_dir, manifest, out, *extra) -> int:
    args = ["--model", str(model_dir), "--manifest", str(manifest), "--output", str(out), "--max_new_tokens", "3"]
    return main([*args, "--batch_size", "2", *extra])


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A saved tiny Qwen3-ASR target and a 3-row manifest."""
    root = tmp_path_factory.mktemp("gen")
    kw = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=1)
    return tiny.save_tiny_target(root / "target", "qwen3_asr", **kw), tiny.synthesize_speech(root / "data", 3, seed=4)


def test_output_that_is_the_manifest_is_refused_and_the_manifest_kept(small, tmp_path):
    model_dir, manifest = small
    before = manifest.read_bytes()
    link = tmp_path / "same_inode.json"
    os.link(manifest, link)
    for out in (manifest, manifest.parent / ".." / manifest.parent.name / manifest.name, link):
        with pytest.raises(ValueError, match="field 'output': .* is the input manifest"):
            _gen(model_dir, manifest, out)
    assert manifest.read_bytes() == before


def _rows(manifest) -> list[dict]:
    """The manifest's rows with absolute audio paths (for manifests written elsewhere)."""
    rows = [json.loads(x) for x in manifest.read_text().splitlines()]
    return [{**r, "audio_filepath": str(manifest.parent / r["audio_filepath"])} for r in rows]


def test_an_existing_output_is_never_modified_in_place(small, tmp_path):
    """A torn last line is not cut off before the checks (the run fails on a bad row: the file is as it was); a
    file that is not this tool's output is refused; a complete run replaces the output in one step."""
    model_dir, manifest = small
    rows = _rows(manifest)
    bad = tmp_path / "bad.json"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows) + json.dumps({**rows[0], "audio_filepath": "nope.wav"}))
    out = tmp_path / "out.json"
    torn = json.dumps({**rows[0], "id": "bad-00000000"}) + "\n" + '{"audio_filepath": "tor'
    out.write_text(torn)
    with pytest.raises(BadSampleError, match="nope.wav"):
        _gen(model_dir, bad, out)
    assert out.read_text() == torn
    foreign = tmp_path / "foreign.json"
    foreign.write_text(manifest.read_text())  # a manifest, not labels: no 'id'
    with pytest.raises(ValueError, match="foreign.json' line 1 is not a row dflash-generate-labels wrote"):
        _gen(model_dir, manifest, foreign)
    assert foreign.read_text() == manifest.read_text()
    assert partial_path(out).exists()  # the rows labelled before the bad one, resumed from by the next run
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))  # the bad row removed
    assert _gen(model_dir, bad, out) == 0
    got = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert got == ["bad-00000000", "bad-00000001", "bad-00000002"]
    assert not partial_path(out).exists()


def test_a_run_reads_the_target_config_and_the_first_row_once(small, tmp_path, monkeypatch):
    """The checks before the target loads read its config and the manifest's first row; the run reuses the config."""
    from dflash_hf.data import json_rows, label_manifest
    from dflash_hf.targets import processor

    model_dir, manifest = small
    calls = {"config": 0, "first row": 0}
    read_config, read_rows = processor.label_target_family, json_rows.json_rows

    def config_read(*args):
        calls["config"] += 1
        return read_config(*args)

    def rows_read(*args, **kwargs):  # what the first-row readers scan (the labelling itself imports its own name)
        calls["first row"] += 1
        return read_rows(*args, **kwargs)

    for module in (processor, label_manifest):
        monkeypatch.setattr(module, "label_target_family", config_read)
    monkeypatch.setattr(json_rows, "json_rows", rows_read)
    assert _gen(model_dir, manifest, tmp_path / "out.json") == 0
    assert calls == {"config": 1, "first row": 1}


def test_an_interrupted_run_resumes_from_its_partial_file(small, tmp_path):
    model_dir, manifest = small
    out = tmp_path / "out.json"
    assert _gen(model_dir, manifest, out) == 0
    complete = out.read_text().splitlines(True)
    out.unlink()
    partial_path(out).write_text(complete[0].replace('"text": "', '"text": "KEPT ') + complete[1][:10])
    assert _gen(model_dir, manifest, out) == 0
    resumed = out.read_text().splitlines(True)
    assert resumed[0].count("KEPT") == 1 and resumed[1:] == complete[1:]
    assert [json.loads(x)["id"] for x in resumed] == [f"manifest-{i:08d}" for i in range(3)]  # the manifest's rows
    assert not partial_path(out).exists()


def _labelled(rows: list[dict], path: Path) -> Path:
    """`rows` written as the lines of a labels file (`path`), as an earlier run leaves them."""
    path.write_text("".join(json.dumps({**r, "reference_text": r["text"], "text": "earlier"}) + "\n" for r in rows))
    return path


def _never_loaded(monkeypatch):
    def loaded(*args):
        raise AssertionError("the target loaded before the earlier lines were checked")

    monkeypatch.setattr("dflash_hf.cli.generate_labels.load_label_target", loaded)


def test_a_partial_file_of_a_longer_manifest_is_refused_before_the_target_loads(small, tmp_path, monkeypatch, capsys):
    """An interrupted run over a longer manifest, resumed with a manifest of its first rows (the same ids): the rows
    of the partial file that are not the manifest's would be kept in the output. One error, exit 2, nothing loaded or
    written."""
    from dflash_hf.cli import console

    model_dir, manifest = small
    rows = [{**r, "id": f"utt{i}"} for i, r in enumerate(_rows(manifest) * 2)]  # 6 rows
    prefix = tmp_path / "prefix.json"
    prefix.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    out = tmp_path / "out.json"
    partial = _labelled(rows[:5], partial_path(out))  # 5 of the longer manifest's 6 rows labelled
    before = partial.read_bytes()
    _never_loaded(monkeypatch)
    argv = ["--model", str(model_dir), "--manifest", str(prefix), "--output", str(out)]
    assert console.run_command("dflash-generate-labels", argv) == 2
    err = capsys.readouterr().err
    assert f"field 'output': {str(partial)!r} holds 3 labelled rows that are not rows of --manifest" in err
    assert "prefix.json' (e.g. 'utt2', 'utt3', 'utt4')" in err and "give a new --output" in err
    assert partial.read_bytes() == before and not out.exists()


def test_a_complete_output_of_another_manifest_is_refused_not_reported_complete(small, tmp_path, monkeypatch):
    """Every row of the manifest is in the output, and rows of another manifest too: refused, not 'complete'."""
    model_dir, manifest = small
    rows = [{**r, "id": f"utt{i}"} for i, r in enumerate(_rows(manifest))]
    longer, prefix = tmp_path / "longer.json", tmp_path / "prefix.json"
    longer.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prefix.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    out = tmp_path / "out.json"
    assert _gen(model_dir, longer, out) == 0
    before = out.read_bytes()
    _never_loaded(monkeypatch)
    with pytest.raises(ValueError, match=r"out.json' holds 1 labelled row that is not a row of .* \(e.g. 'utt2'\)"):
        _gen(model_dir, prefix, out)
    assert out.read_bytes() == before and not partial_path(out).exists()


def test_a_shard_resumes_its_own_output_and_refuses_another_shards(small, tmp_path, monkeypatch):
    """Shard 0 of 2 (rows 0, 1) resumes from its own partial file; given shard 1's output, or the whole manifest's,
    it refuses: before the target loads, or, with --skip_bad_samples (rows it skips move the shards' bounds), once the
    run has read its rows (the whole output then covers all of shard 0: refused, not reported complete)."""
    model_dir, manifest = small
    shard = ["--num_shards", "2", "--shard_index"]
    part0, part1 = tmp_path / "part0.json", tmp_path / "part1.json"
    _labelled([{**r, "id": "manifest-00000000"} for r in _rows(manifest)[:1]], partial_path(part0))
    assert _gen(model_dir, manifest, part0, *shard, "0") == 0
    assert [json.loads(x)["id"] for x in part0.read_text().splitlines()] == ["manifest-00000000", "manifest-00000001"]
    assert json.loads(part0.read_text().splitlines()[0])["text"] == "earlier"  # resumed, not labelled again
    assert _gen(model_dir, manifest, part1, *shard, "1") == 0
    whole = tmp_path / "whole.json"
    whole.write_text(part0.read_text() + part1.read_text())
    message = r"holds 1 labelled row that is not a row of --manifest .* \(--num_shards 2 --shard_index 0\) \(e.g. "
    with monkeypatch.context() as m:
        _never_loaded(m)
        for out in (part1, whole):
            with pytest.raises(ValueError, match=f"{out.name}' {message}'manifest-00000002'"):
                _gen(model_dir, manifest, out, *shard, "0")
    for out in (part1, whole):
        before = out.read_bytes()
        with pytest.raises(ValueError, match=f"{out.name}' {message}'manifest-00000002'"):
            _gen(model_dir, manifest, out, *shard, "0", "--skip_bad_samples", "true")
        assert out.read_bytes() == before and not partial_path(out).exists()


def test_a_partial_file_whose_rows_shifted_with_a_deleted_line_is_refused(small, tmp_path, monkeypatch, capsys):
    """Rows without an 'id' take one by position: with a line of the manifest deleted since, the earlier lines' ids
    name other rows (same ids, other audio and text). One error naming a line and its fields, exit 2, before the
    target loads; nothing written."""
    from dflash_hf.cli import console

    model_dir, manifest = small
    rows = _rows(manifest) * 2  # 6 rows, no ids: 'shifted-00000000' ..
    shifted = tmp_path / "shifted.json"
    out = tmp_path / "out.json"
    partial = _labelled([{**r, "id": f"shifted-{i:08d}"} for i, r in enumerate(rows[:3])], partial_path(out))
    before = partial.read_bytes()
    shifted.write_text("".join(json.dumps(r) + "\n" for i, r in enumerate(rows) if i != 1))  # line 1 deleted
    _never_loaded(monkeypatch)
    argv = ["--model", str(model_dir), "--manifest", str(shifted), "--output", str(out)]
    assert console.run_command("dflash-generate-labels", argv) == 2
    err = capsys.readouterr().err
    assert f"field 'output': {str(partial)!r} holds 2 labelled rows that are not the rows their ids name" in err
    assert "(e.g. line 2, id 'shifted-00000001': its 'audio_filepath', 'duration', 'reference_text' differ" in err
    assert "ids by position (lines without an 'id') shifted" in err and "give a new --output" in err
    assert partial.read_bytes() == before and not out.exists()


def test_a_partial_file_of_an_edited_row_is_refused_before_loading_and_by_the_run(small, tmp_path, monkeypatch):
    """Rows with their own ids, one whose text was edited since it was labelled: refused before the target loads,
    and by the run itself (its own check, after it has read the rows); the partial file is left as it is."""
    from dflash_hf.data import label_manifest

    model_dir, manifest = small
    rows = [{**r, "id": f"utt{i}"} for i, r in enumerate(_rows(manifest))]
    edited = tmp_path / "edited.json"
    out = tmp_path / "out.json"
    partial = _labelled(rows[:2], partial_path(out))
    before = partial.read_bytes()
    rows[1]["text"] += " again"
    edited.write_text("".join(json.dumps(r) + "\n" for r in rows))
    message = r"holds 1 labelled row that is not the row its id names .* \(e.g. line 2, id 'utt1': its 'reference_text'"
    with monkeypatch.context() as m:
        _never_loaded(m)
        with pytest.raises(ValueError, match=message):
            _gen(model_dir, edited, out)
    monkeypatch.setattr(label_manifest, "check_resumable", lambda *args: None)  # the run's own check
    with pytest.raises(ValueError, match=message):
        _gen(model_dir, edited, out)
    assert partial.read_bytes() == before and not out.exists()


def test_an_output_elsewhere_named_otherwise_resumes(small, tmp_path, monkeypatch):
    """The output in another directory than the manifest (its audio paths re-expressed relative to it), resumed with
    the manifest and output named by other paths (relative from another directory, then absolute): the same rows,
    resumed and not labelled again."""
    model_dir, manifest = small
    moved = tmp_path / "in" / "moved.json"
    moved.parent.mkdir()
    rows = _rows(manifest)  # absolute audio paths; all but the last made relative to the manifest's new directory
    rows[:2] = [{**r, "audio_filepath": os.path.relpath(r["audio_filepath"], moved.parent)} for r in rows[:2]]
    moved.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "labels" / "deeper" / "out.json"
    out.parent.mkdir(parents=True)
    monkeypatch.chdir(out.parent)
    assert _gen(model_dir, Path("..") / ".." / "in" / "moved.json", "out.json") == 0
    complete = out.read_text().splitlines(True)
    assert json.loads(complete[0])["audio_filepath"] == os.path.relpath(moved.parent / rows[0]["audio_filepath"])
    assert json.loads(complete[0])["audio_filepath"] != rows[0]["audio_filepath"]  # relocated
    out.unlink()
    partial_path(out).write_text("".join(x.replace('"text": "', '"text": "KEPT ', 1) for x in complete[:2]))
    assert _gen(model_dir, moved, out) == 0
    resumed = out.read_text().splitlines(True)
    assert [x.count("KEPT") for x in resumed] == [1, 1, 0] and resumed[2] == complete[2]


def test_text_rows_are_matched_by_their_context(tmp_path):
    """A text target's rows (an empty ``text``, a ``context``) without ids, the first line deleted since: the earlier
    lines are matched by their context too (a text alone would not tell them apart)."""
    from dflash_hf.data.label_rows import check_resumable

    rows = [{"text": "", "context": f"Say {word}."} for word in ("one", "two", "three")]
    manifest, out = tmp_path / "prompts.json", tmp_path / "out.json"
    _labelled([{**r, "id": f"prompts-{i:08d}"} for i, r in enumerate(rows[:2])], partial_path(out))
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    check_resumable(str(manifest), str(out), "reference_text", 1, 0, False)  # the rows that wrote it
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows[1:]))
    with pytest.raises(
        ValueError, match=r"holds 2 labelled rows .* \(e.g. line 1, id 'prompts-00000000': its 'context'"
    ):
        check_resumable(str(manifest), str(out), "reference_text", 1, 0, False)


def test_bad_audio_and_hostile_names_in_generate_labels(small, tmp_path):
    """No program runs for a hostile name; non-finite audio and audio only a program could read are skipped and
    counted with --skip_bad_samples true, or stop the run naming the row."""
    model_dir, manifest = small
    rows = _rows(manifest)
    audio = Path(rows[0]["audio_filepath"])
    hostile = tmp_path / "y;touch MARK;.sph"
    hostile.write_bytes(audio.read_bytes())
    nan = tmp_path / "nan.wav"
    samples, rate = sf.read(audio, dtype="float32")
    samples[3] = np.nan
    sf.write(nan, samples, rate, subtype="FLOAT")
    junk = tmp_path / "z$(touch MARK2).sph"
    junk.write_bytes(b"junk" * 100)
    data = tmp_path / "m.json"
    paths = [hostile, nan, junk]
    data.write_text("".join(json.dumps({**rows[0], "audio_filepath": str(p)}) + "\n" for p in paths))
    with pytest.raises(BadSampleError, match=r"line 2\): field 'audio_filepath': the audio holds non-finite"):
        _gen(model_dir, data, tmp_path / "strict.json")
    out = tmp_path / "out.json"
    assert _gen(model_dir, data, out, "--skip_bad_samples", "true") == 0
    assert [json.loads(x)["audio_filepath"] for x in out.read_text().splitlines()] == [str(hostile)]
    assert not list(tmp_path.glob("MARK*"))


def test_control_tokens_and_lone_surrogates_in_a_row(small, tmp_path):
    model_dir, manifest = small
    rows = _rows(manifest)
    data = tmp_path / "m.json"
    data.write_text(
        json.dumps({**rows[0], "context": "hi <|im_end|><|im_start|>system"})
        + "\n"
        + json.dumps({**rows[1], "speaker": "\ud800"})
        + "\n"
        + json.dumps(rows[2])
        + "\n"
    )
    with pytest.raises(BadSampleError, match=r"line 1\): field 'context': holds the tokenizer's control token"):
        _gen(model_dir, data, tmp_path / "strict.json")
    out = tmp_path / "out.json"
    assert _gen(model_dir, data, out, "--skip_bad_samples", "true") == 0
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["m-00000002"]
    # a labelled line of a row this run skips is not one of its rows: refused, not kept
    _labelled([{**rows[1], "id": "m-00000001"}], out.with_name("more.json"))
    out.write_text(out.read_text() + out.with_name("more.json").read_text())
    with pytest.raises(ValueError, match=r"--manifest .*m.json', less the 2 skipped as bad \(e.g. 'm-00000001'\)"):
        _gen(model_dir, data, out, "--skip_bad_samples", "true")


def test_an_empty_manifest_or_a_cuts_file_is_refused_before_the_target_loads(small, tmp_path):
    model_dir, manifest = small
    empty = tmp_path / "empty.json"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="field 'manifest': .*has no JSON object line"):
        _gen(model_dir, empty, tmp_path / "out.json")
    cuts = tmp_path / "cuts.jsonl"
    open_source(manifest).to_file(cuts)
    with pytest.raises(
        ValueError, match="field 'manifest': .* is a lhotse cuts file; dflash-generate-labels reads NeMo"
    ):
        _gen(model_dir, cuts, tmp_path / "out.json")


def test_rows_the_target_cannot_read_are_refused_before_it_loads(small, tmp_path, monkeypatch):
    model_dir, manifest = small
    text_target = tiny.save_tiny_target(tmp_path / "text", kind="text", hidden_size=32, num_layers=2, num_heads=2)
    text_rows = tmp_path / "prompts.json"
    text_rows.write_text(json.dumps({"text": "yes", "context": "Say yes."}) + "\n")

    def loaded(*args):
        raise AssertionError("the target loaded before the rows were checked")

    monkeypatch.setattr("dflash_hf.cli.generate_labels.load_label_target", loaded)
    with pytest.raises(ValueError, match="field 'manifest': the rows of .* have no audio .* an audio target"):
        _gen(model_dir, text_rows, tmp_path / "out.json")
    with pytest.raises(ValueError, match="field 'manifest': the rows of .* have audio .* is a text target"):
        _gen(text_target, manifest, tmp_path / "out.json")


def test_truncated_outputs_are_marked_and_the_summary_counts_them(small, tmp_path, capsys):
    """Every output cut by `--max_new_tokens` before the target's end is marked `truncated` (it trains without an end of
    turn, tests/data/test_generated_fields.py); `label_ids`, where written, are the target's own ids."""
    model_dir, manifest = small
    out = tmp_path / "labels.json"
    assert (
        main(["--model", str(model_dir), "--manifest", str(manifest), "--output", str(out), "--max_new_tokens", "6"])
        == 0
    )
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    model, processor = tiny.build_qwen3_asr_target(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=1)
    tok = processor.tokenizer
    for row, line in zip(rows, _rows(manifest)):
        raw = _greedy_ids(model, processor, line, 6)
        ended = tok.eos_token_id in raw
        assert row.get("truncated", False) == (not ended)
        written = raw[: raw.index(tok.eos_token_id)] if ended else raw
        assert row.get("label_ids", written) == written
    truncated, kept = sum("truncated" in r for r in rows), sum("label_ids" in r for r in rows)
    assert truncated == 3  # this target's 6 tokens never end
    summary = capsys.readouterr().out
    assert f"{truncated} cut by --max_new_tokens" in summary and f"{kept} whose text re-encodes" in summary


def test_ids_are_kept_only_where_the_text_re_encodes_to_other_tokens():
    from dflash_hf.data.conversation import ConversationConfig, ConversationRenderer
    from dflash_hf.data.label_rows import LabelCounts, generated_line
    from dflash_hf.data.sources import make_cut
    from dflash_hf.targets.families.registry import resolve_family

    model, processor = tiny.build_qwen3_asr_target(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    tok = processor.tokenizer
    renderer = ConversationRenderer(processor, resolve_family(model.config), ConversationConfig())
    cut = make_cut("c", None, 0.0, 1.0, "reference", "en", {"speaker": "s"})
    end, counts = tok.eos_token_id, LabelCounts()
    ids = tok("yes no", add_special_tokens=False)["input_ids"]
    spaced = tok(" yes no", add_special_tokens=False)["input_ids"]  # stripped from the text, so lost in it
    split = ids[:2] + [tok.convert_tokens_to_ids(tiny.IM_START)] + ids[2:]  # a special token the decoding skips
    audio = tok.convert_tokens_to_ids(tiny.AUDIO_PAD)

    def line(ids):
        return generated_line(cut, ids, {end}, renderer, counts, audio)

    assert line(ids + [end, end]) == {"text": "yes no"}
    assert line(spaced + [end]) == {"text": "yes no", "label_ids": spaced}
    assert line(split + [end]) == {"text": "yes no", "label_ids": split}
    assert line(ids) == {"text": "yes no", "truncated": True}
    assert line([10, 10]) == {"text": "", "truncated": True}
    assert line(ids[:2] + [audio] + ids[2:] + [end]) == {"text": "yes no"}  # never the audio placeholder
    assert (counts.truncated, counts.label_ids, counts.ids_not_kept) == (2, 2, 1)


def test_whisper_ids_whose_text_renders_to_them_are_not_kept():
    """Whisper's output `" yes no"` (the space its own token in the tiny tokenizer): the row rendered from the text is
    already the target's stream (the template writes the space before the transcript), so no `label_ids`."""
    from utils import tiny_whisper

    from dflash_hf.data.conversation import ConversationConfig, ConversationRenderer
    from dflash_hf.data.label_rows import LabelCounts, generated_line
    from dflash_hf.data.sources import make_cut
    from dflash_hf.targets.families.registry import resolve_family

    model, processor = tiny_whisper()
    tok = processor.tokenizer
    renderer = ConversationRenderer(processor, resolve_family(model.config), ConversationConfig())
    cut = make_cut("c", None, 0.0, 1.0, "reference", "en", {})
    counts, end = LabelCounts(), tok.eos_token_id
    written = tok(" yes no", add_special_tokens=False)["input_ids"]
    assert generated_line(cut, written + [end], {end}, renderer, counts, None) == {"text": "yes no"}
    unspaced = tok("yes no", add_special_tokens=False)["input_ids"]  # no space: the template's is not the target's
    assert generated_line(cut, unspaced + [end], {end}, renderer, counts, None) == {
        "text": "yes no",
        "label_ids": unspaced,
    }
    assert (counts.label_ids, counts.ids_not_kept) == (1, 0)


def test_a_row_id_that_is_not_a_string_or_integer_takes_the_id_training_gives_the_line(tmp_path):
    """A text target's rows (text, no audio) are labelled; they skip the audio rows' checks, so an `id` of null or true
    is replaced by the line's own id (the one training gives it): two such rows never share an id, which resuming
    matches rows by."""
    model_dir = tiny.save_tiny_target(tmp_path / "target", kind="text", hidden_size=32, num_layers=2, num_heads=2)
    data = tmp_path / "m.json"
    data.write_text(
        "".join(json.dumps({"text": t, "id": i}) + "\n" for t, i in [("yes", None), ("no", None), ("up", True)])
    )
    out = tmp_path / "out.json"
    assert _gen(model_dir, data, out) == 0
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["m-00000000", "m-00000001", "m-00000002"]


TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 73.30 GiB. GPU 0 has a total capacity of 79.19 GiB of which 5.12 GiB is "
    "free. Of the allocated memory 70.01 GiB is allocated by PyTorch. If reserved but unallocated memory is large try "
    "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)


def test_gpu_out_of_memory_in_a_batch_stops_with_exit_75_and_the_rerun_resumes(small, tmp_path, monkeypatch, capsys):
    """The second batch's generate runs out of GPU memory: one line naming the batch, torch's reason, --batch_size with
    its value and the rows already written, exit status 75; the partial file holds exactly the first batch's rows, and
    the same command labels only the rest."""
    from dflash_hf.cli import console
    from dflash_hf.errors import ENVIRONMENT_FAULT_EXIT_CODE
    from dflash_hf.generation import target_generate

    model_dir, manifest = small
    out = tmp_path / "out.json"
    argv = ["--model", str(model_dir), "--manifest", str(manifest), "--output", str(out), "--max_new_tokens", "3"]
    argv += ["--batch_size", "2"]
    generate, prompts = target_generate.target_generate_new_tokens, []

    def second_batch_fails(ft, inputs, *args, **kwargs):
        prompts.append(len(inputs["input_ids"]))
        if len(prompts) == 2:
            raise torch.OutOfMemoryError(TORCH_OOM)
        return generate(ft, inputs, *args, **kwargs)

    monkeypatch.setattr(target_generate, "target_generate_new_tokens", second_batch_fails)
    assert console.run_command("dflash-generate-labels", argv) == ENVIRONMENT_FAULT_EXIT_CODE == 75
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "stopped:" in x]  # one line (the progress bars write to stderr too)
    assert line.startswith(
        "dflash-generate-labels: stopped: GPU out of memory generating labels for a batch of 1 prompt,"
    )
    assert "(CUDA out of memory. Tried to allocate 73.30 GiB)" in line and "GPU 0 has" not in line
    assert "lower --batch_size (now 2; e.g. 1)" in line and "--dtype bfloat16" in line
    assert f"{str(partial_path(out))!r} holds the 2 rows labelled so far (2 written by this run)" in line
    assert "the same command with the same --output resumes from there" in line and "Traceback" not in err
    assert not out.exists()
    kept = partial_path(out).read_text()
    assert [json.loads(x)["id"] for x in kept.splitlines()] == ["manifest-00000000", "manifest-00000001"]

    prompts.clear()
    assert console.run_command("dflash-generate-labels", argv) == 0
    assert prompts == [1]  # only the row the stopped run had not written
    assert out.read_text().startswith(kept) and len(out.read_text().splitlines()) == 3
    assert not partial_path(out).exists()


def test_the_out_of_memory_message_counts_the_lines_of_the_partial_file(small, tmp_path, monkeypatch):
    """The rows kept are the partial file's lines (two here, of one row: the id twice), not its distinct ids."""
    from dflash_hf.errors import OutputKeptFault
    from dflash_hf.generation import target_generate

    model_dir, manifest = small
    out = tmp_path / "out.json"
    row = {**_rows(manifest)[0], "id": "manifest-00000000"}
    _labelled([row, row], partial_path(out))

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(TORCH_OOM)

    monkeypatch.setattr(target_generate, "target_generate_new_tokens", out_of_memory)
    with pytest.raises(OutputKeptFault, match=r"out.json.partial' holds the 2 rows labelled so far \(0 written by"):
        _gen(model_dir, manifest, out)


def test_the_out_of_memory_message_fits_the_target(tmp_path):
    """A target whose forward takes no `logits_to_keep` (Qwen2-Audio) holds every prompt position's logits at prefill:
    the message gives their size; a target that decodes one prompt at a time does not offer --batch_size; one loaded
    in bfloat16 is not offered --dtype bfloat16."""
    from targets.test_families import build_qwen2_audio

    from dflash_hf.data.conversation import ConversationConfig
    from dflash_hf.data.label_manifest import LabelJob, out_of_memory
    from dflash_hf.targets.frozen import FrozenTarget

    model, _ = build_qwen2_audio(tiny.build_tokenizer())
    names = dict(manifest=str(tmp_path / "m.json"), output=str(tmp_path / "o.json"), reference_key="reference_text")
    flags = dict(skip_bad_samples=False, allow_command_audio_sources=False, prefetch=True)
    job = LabelJob(**names, **flags, batch_size=250, conversation=ConversationConfig(), num_shards=1, shard_index=0)
    encoded = [{"input_ids": torch.zeros(3, 40, dtype=torch.long), "attention_mask": torch.ones(3, 40)}]
    error = torch.OutOfMemoryError(TORCH_OOM)
    vocab = model.get_output_embeddings().weight.shape[0]
    text = str(out_of_memory(error, job, FrozenTarget(model), encoded, 3, 0, 0))
    assert text.startswith("GPU out of memory generating labels for a batch of 3 prompts, the longest 40 tokens")
    logits = f"3 x 40 x vocabulary {vocab} in float32: {3 * 40 * vocab * 4 / 2**30:.1f} GiB"
    assert f"takes no logits_to_keep, so its prefill holds the logits of every prompt position ({logits})" in text
    assert "lower --batch_size (now 250; e.g. 125), or load the target with --dtype bfloat16" in text
    assert f"No row is labelled yet ({str(tmp_path / 'o.json.partial')!r} is empty)" in text

    single = FrozenTarget(model, "qwen2_audio_single_placeholder")
    one = [{"input_ids": torch.zeros(1, 9, dtype=torch.long)} for _ in range(3)]
    text = str(out_of_memory(error, job, single, one, 3, 5, 1))
    assert "decodes one prompt at a time: --batch_size (now 250) does not change it" in text
    assert "lower --batch_size" not in text and "the longest" not in text and "(1 written by this run)" in text

    text = str(out_of_memory(error, job, FrozenTarget(model.to(torch.bfloat16)), encoded, 3, 0, 0))
    assert "in bfloat16:" in text and "--dtype bfloat16" not in text
