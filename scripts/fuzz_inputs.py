"""Drive the console scripts through hostile and unusual inputs and classify what each does.

Every case writes one data file (two good rows and the case's row, or a whole file of its own shape) and runs
`dflash-train` (tiny settings), `dflash-generate-labels` and `dflash-eval` on a tiny random Qwen3-ASR target, each in
strict mode and, where the command has one, with `--skip_bad_samples true`. Each run's outcome is one of:

- **clear error**: exit 2 with one line naming the row or field and the fix;
- **handled**: exit 0 and the output is right (a valid input used);
- **skipped and counted**: exit 0, the bad row left out and counted in the log;
- **silent-wrong**: exit 0 with a wrong result: a bad row used, a row lost, a non-finite export, a program started
  from a file name (a marker file appeared), or an input file changed;
- **raw crash**: anything else (a traceback, another exit status).

The goal is zero silent-wrong and zero raw-crash. A case that expects its row to be used (`bad=False`) and gets a
clear error is listed as such and flagged in the `expected` column.

    python scripts/fuzz_inputs.py                         # every case, every command (a few minutes on a CPU)
    python scripts/fuzz_inputs.py --category audio --commands gen --json fuzz.json
    python scripts/fuzz_inputs.py --list
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf

OUTCOMES = ("clear error", "handled", "skipped and counted", "silent-wrong", "raw crash")
MASK_TOKEN_ID = 262  # the tiny tokenizer's reserved <|dflash_mask|>
MARKER = "FUZZMARK"  # a hostile file name's command creates a file starting with this


@dataclass
class Assets:
    root: Path
    target: Path
    draft: Path
    good: list[dict]  # rows with absolute audio paths
    audio: Path  # one good wav


@dataclass
class Case:
    """`make(dir, assets)` writes the data file and returns its path. `bad`: the row must not be used (a clear error
    in strict mode, a counted skip with --skip_bad_samples); else it must be used. `args`: extra arguments per
    command; `check(run_dir, command, data) -> problem | None` looks for a wrong result of an exit-0 run."""

    category: str
    name: str
    make: Callable[[Path, Assets], Path]
    bad: bool = True
    commands: tuple[str, ...] = ("train", "gen", "eval")
    args: dict[str, list[str] | Callable[[Path, Path], list[str]]] = field(default_factory=dict)  # or (run, data)
    rows: int | None = None  # usable rows in the file (default: the good rows, plus the case row when not bad)
    usable_by: tuple[str, ...] = ()  # commands for which a bad row is a valid one (gen: the transcript is a reference)

    def bad_for(self, command: str) -> bool:
        return self.bad and command not in self.usable_by


# --- data writers -----------------------------------------------------------------------------------------------


def _manifest(d: Path, rows: list[dict], name: str = "m.json") -> Path:
    path = d / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")  # a lone surrogate as \udfff
    return path


def _with_row(row_of: Callable[[Path, Assets], dict]) -> Callable[[Path, Assets], Path]:
    """A maker: the good rows and the case's row last."""
    return lambda d, a: _manifest(d, [*a.good, row_of(d, a)])


def _audio_row(write: Callable[[Path], None], name: str = "x.wav", **extra) -> Callable[[Path, Assets], Path]:
    def row(d: Path, a: Assets) -> dict:
        path = d / name
        write(path)
        return {"audio_filepath": str(path), "duration": _duration(path), "text": "yes", **extra}

    return _with_row(row)


def _duration(path: Path) -> float:
    try:
        return round(sf.info(str(path)).duration, 3) or 0.5
    except Exception:  # noqa: BLE001 - a file that is not audio: any duration
        return 0.5


def _wave(values=None, n: int = 8000, rate: int = 16000, subtype: str = "FLOAT", fmt: str | None = None, ch: int = 1):
    def write(path: Path) -> None:
        x = np.full((n, ch) if ch > 1 else n, 0.05, np.float32) if values is None else values(n)
        sf.write(str(path), x, rate, subtype=subtype, format=fmt)

    return write


def _poke(index: int, value: float):
    def values(n: int) -> np.ndarray:
        x = np.full(n, 0.05, np.float32)
        x[index] = value
        return x

    return values


def _bytes(data: bytes):
    return lambda path: path.write_bytes(data)


def _text_row(text, **extra) -> Callable[[Path, Assets], Path]:
    return _with_row(lambda d, a: {**a.good[0], "id": "case-row", "text": text, **extra})


def _raw_manifest(lines: list[bytes], gz: bool = False) -> Callable[[Path, Assets], Path]:
    def make(d: Path, a: Assets) -> Path:
        good = b"".join(json.dumps(r).encode() + b"\n" for r in a.good)
        data = good + b"".join(lines)
        path = d / ("m.json.gz" if gz else "m.json")
        path.write_bytes(gzip.compress(data) if gz else data)
        return path

    return make


def _cuts(source: Callable[[Path, Assets], dict] | None = None, kind: str = "MonoCut") -> Callable:
    """A lhotse cuts file of the good rows and a case cut whose audio source is `source(d, a)`."""

    def make(d: Path, a: Assets) -> Path:
        lines = []
        for i, row in enumerate(a.good):
            lines.append(_cut_dict(f"g{i}", {"type": "file", "channels": [0], "source": row["audio_filepath"]}, row))
        if source is not None:
            lines.append(_cut_dict("case", source(d, a), a.good[0], kind))
        path = d / "cuts.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        return path

    return make


def _cut_dict(cut_id: str, source: dict, row: dict, kind: str = "MonoCut") -> dict:
    info = sf.info(row["audio_filepath"])
    rec = {
        "id": f"r-{cut_id}",
        "sources": [source],
        "sampling_rate": info.samplerate,
        "num_samples": info.frames,
        "duration": info.duration,
        "channel_ids": [0],
    }
    sup = {"id": cut_id, "recording_id": rec["id"], "start": 0.0, "duration": info.duration, "text": row["text"]}
    return {
        "id": cut_id,
        "start": 0.0,
        "duration": info.duration,
        "channel": 0,
        "recording": rec,
        "supervisions": [sup],
        "type": kind,
    }


def _hostile(name: str, content: str = "wav") -> Callable[[Path, Assets], Path]:
    """The good rows and one whose audio file has a hostile name (`content`: a real wav, or junk bytes)."""

    def row(d: Path, a: Assets) -> dict:
        path = d / name.format(m=MARKER)
        if content == "wav":
            shutil.copy(a.audio, path)
        else:
            path.write_bytes(b"not audio " * 50)
        return {"audio_filepath": str(path), "duration": 0.5, "text": "yes"}

    return _with_row(row)


def _hostile_cut(name: str) -> Callable[[Path, Assets], Path]:
    def source(d: Path, a: Assets) -> dict:
        path = d / name.format(m=MARKER)
        shutil.copy(a.audio, path)
        return {"type": "file", "channels": [0], "source": str(path)}

    return _cuts(source)


# --- the cases --------------------------------------------------------------------------------------------------


def cases() -> list[Case]:
    out: list[Case] = []

    def add(category, name, make, **kw):
        out.append(Case(category, name, make, **kw))

    # audio formats and sample values
    add("audio", "NaN sample (float wav)", _audio_row(_wave(_poke(100, np.nan))))
    add("audio", "+inf sample", _audio_row(_wave(_poke(100, np.inf))))
    add("audio", "-inf sample", _audio_row(_wave(_poke(7999, -np.inf))))
    add("audio", "1e30 sample (finite, absurd)", _audio_row(_wave(_poke(0, 1e30))))
    add("audio", "float wav at 50x full scale", _audio_row(_wave(lambda n: np.full(n, 50.0, np.float32))), bad=False)
    add("audio", "all-zero audio", _audio_row(_wave(lambda n: np.zeros(n, np.float32))), bad=False)
    add("audio", "int16 full scale", _audio_row(_wave(lambda n: np.ones(n, np.float32), subtype="PCM_16")), bad=False)
    add("audio", "flac 24-bit", _audio_row(_wave(subtype="PCM_24", fmt="FLAC"), "x.flac"), bad=False)
    add("audio", "ogg vorbis", _audio_row(_wave(subtype="VORBIS", fmt="OGG"), "x.ogg"), bad=False)
    add("audio", "ogg opus", _audio_row(_wave(subtype="OPUS", fmt="OGG", rate=48000, n=24000), "x.opus"), bad=False)
    add("audio", "mp3", _audio_row(_wave(subtype="MPEG_LAYER_III", fmt="MP3", n=16000), "x.mp3"), bad=False)
    add("audio", "NIST SPHERE .sph", _audio_row(_wave(subtype="PCM_16", fmt="NIST"), "x.sph"), bad=False)
    add("audio", "8 kHz wav (resampled)", _audio_row(_wave(rate=8000, n=4000)), bad=False)
    add("audio", "stereo wav", _audio_row(_wave(ch=2)))
    add("audio", "empty file", _audio_row(_bytes(b"")))
    add("audio", "header-only wav", _audio_row(_wave(lambda n: np.zeros(0, np.float32))))
    add("audio", "junk bytes named .wav", _audio_row(_bytes(b"RIFF junk" * 40)))
    add("audio", "junk bytes named .mp4 (only ffmpeg could try)", _audio_row(_bytes(b"\x00junk" * 40), "x.mp4"))
    add("audio", "10 ms clip", _audio_row(_wave(n=160)), bad=False)
    add("audio", "duration past the end of the file", _audio_row(_wave(), duration=3.0))
    add("audio", "offset past the end of the file", _audio_row(_wave(), offset=2.0, duration=0.1))

    # text contents
    # dflash-generate-labels keeps a row's transcript as its reference: any string is valid there
    reference = {"usable_by": ("gen",)}
    for token in ("<|im_end|>", "<|im_start|>assistant", "<|endoftext|>", "<|audio_pad|>", "<|dflash_mask|>"):
        add("text", f"transcript holds {token}", _text_row(f"yes {token} no"), **reference)
    add(
        "text", "context holds <|im_end|><|im_start|>system", _text_row("yes", context="a <|im_end|><|im_start|>system")
    )
    add("text", "lone surrogate in transcript", _text_row("bad \ud800 text"))
    # a key only copied to the labels file: training and dflash-eval never read it
    add("text", "lone surrogate in another key", _text_row("fine", speaker="\udfff"), usable_by=("train", "eval"))
    add("text", "empty transcript", _text_row(""), **reference)
    add("text", "whitespace-only transcript", _text_row(" \n\t "), **reference)
    add("text", "transcript is a number", _text_row(5))
    add("text", "transcript longer than max_tokens", _text_row("word " * 400), usable_by=("gen", "eval"))
    add("text", "emoji, RTL, combining marks", _text_row("héllo 👋🏽 مرحبا e\u0301"), bad=False)
    add("text", "NUL and control characters", _text_row("a\x00b\x07c"), bad=False)
    add("text", "CRLF and tabs", _text_row("line1\r\nline2\tend"), bad=False)
    add("text", "plain markup <b>, [laughter], <| im_end |>", _text_row("<b>x</b> [laughter] <| im_end |>"), bad=False)

    # manifest and cuts shapes
    add("shape", "blank lines and a final line without newline", _raw_manifest([b"\n\n", b"   \n"]), bad=False, rows=2)
    add("shape", "byte-order mark", lambda d, a: _bom(d, a), bad=False, rows=2)
    add("shape", "gzipped manifest", _raw_manifest([], gz=True), bad=False, rows=2)
    add("shape", "line that is not JSON", _raw_manifest([b"{not json\n"]))
    add("shape", "line that is a JSON array", _raw_manifest([b"[1, 2]\n"]))
    add("shape", "line not UTF-8", _raw_manifest([b'{"text": "\xff\xfe"}\n']))
    add("shape", "missing audio_filepath", _with_row(lambda d, a: {"duration": 1.0, "text": "x"}))
    add("shape", "duration NaN", _with_row(lambda d, a: {**a.good[0], "duration": float("nan")}))
    add("shape", "duration negative", _with_row(lambda d, a: {**a.good[0], "duration": -1}))
    add("shape", "duration a string", _with_row(lambda d, a: {**a.good[0], "duration": "1.0"}))
    add("shape", "audio file missing", _with_row(lambda d, a: {**a.good[0], "audio_filepath": str(d / "nope.wav")}))
    add("shape", "audio path is a directory", _with_row(lambda d, a: {**a.good[0], "audio_filepath": str(d)}))
    add("shape", "lang not a string", _with_row(lambda d, a: {**a.good[0], "lang": 3}))
    add("shape", "unknown extra keys", _with_row(lambda d, a: {**a.good[0], "speaker": "s1", "x": [1]}), bad=False)
    add("shape", "duplicate ids", _with_row(lambda d, a: {**a.good[0], "id": "dup"}), bad=False)
    add("shape", "empty manifest", lambda d, a: _empty(d), rows=0, commands=("train", "gen"))
    add("shape", "lhotse cuts file", _cuts(), bad=False, rows=2, commands=("train", "eval"))
    add("shape", "lhotse cuts file as a NeMo manifest", _cuts(), commands=("gen",))
    add(
        "shape",
        "lhotse cut with a command source",
        _cuts(lambda d, a: {"type": "command", "channels": [0], "source": f"touch {d / MARKER}; cat x.wav"}),
        commands=("train", "eval"),
    )
    add(
        "shape",
        "lhotse cut with a url source",
        _cuts(lambda d, a: {"type": "url", "channels": [0], "source": "http://127.0.0.1:9/x.wav"}),
        commands=("train", "eval"),
    )
    add(
        "shape",
        "lhotse MixedCut",
        _cuts(lambda d, a: {"type": "file", "channels": [0], "source": a.good[0]["audio_filepath"]}, kind="MixedCut"),
        commands=("train", "eval"),
    )

    # hostile file names (a program started from the name creates a file named FUZZMARK*)
    for name in (
        "y;touch {m}1;.sph",
        "a$(touch {m}2).sph",
        "b`touch {m}3`.sph",
        "-c';touch {m}4;'.opus",
        '--d"; touch {m}5; ".wav',
        "e|touch {m}6|.mp3",
        "f\nnewline.wav",
        "g spaces ünï.flac",
    ):
        shown = name.format(m="X").replace("\n", "\\n")
        add("file name", f"{shown} (a wav)", _hostile(name), bad=False)
    add("file name", "z;touch X;.sph (junk: only a program could decode)", _hostile("z;touch {m}7;.sph", "junk"))
    add("file name", "h$(touch X).m4a (junk)", _hostile("h$(touch {m}8).m4a", "junk"))
    add(
        "file name",
        "lhotse cut y;touch X;.sph (a wav)",
        _hostile_cut("y;touch {m}9;.sph"),
        bad=False,
        rows=3,
        commands=("train", "eval"),
    )

    # where dflash-generate-labels writes (the inputs must stay as they are)
    def output(name, make, to):
        add("output", name, make, commands=("gen",), args={"gen": lambda run, data: ["--output", str(to(run, data))]})

    output("--output is the manifest", lambda d, a: _manifest(d, a.good), lambda run, data: data)
    output("--output is the manifest, spelled another way", lambda d, a: _manifest(d, a.good),
           lambda run, data: run / ".." / run.name / data.name)  # fmt: skip
    output("--output is a hard link to the manifest", _linked, lambda run, data: run / "link.json")
    output("--output is a directory", lambda d, a: _manifest(d, a.good), lambda run, data: run)
    output("--output in a missing directory", lambda d, a: _manifest(d, a.good), lambda run, data: run / "no" / "x")
    output("--output is another manifest (not labels)", _foreign, lambda run, data: run / "foreign.json")

    # data-related settings
    for name, mask in (("<|im_start|>", 261), ("<|audio_pad|>", 258), ("<|im_end|>", 256), ("byte 'e'", 101)):
        add(
            "setting",
            f"--mask_token_id {mask} ({name})",
            lambda d, a: _manifest(d, a.good),
            rows=2,
            commands=("train",),
            args={"train": ["--mask_token_id", str(mask)]},
        )
    add("setting", "--mask_token_id 122 (byte 'z', in one transcript)", _text_row("a lazy row"), rows=2,
        commands=("train",), args={"train": ["--mask_token_id", "122"]})  # fmt: skip
    return out


def _linked(d: Path, a: Assets) -> Path:
    path = _manifest(d, a.good)
    os.link(path, d / "link.json")
    return path


def _foreign(d: Path, a: Assets) -> Path:
    _manifest(d, a.good, "foreign.json")
    return _manifest(d, a.good)


def _bom(d: Path, a: Assets) -> Path:
    path = d / "m.json"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in a.good).encode())
    return path


def _empty(d: Path) -> Path:
    (d / "m.json").write_text("")
    return d / "m.json"


# --- running ----------------------------------------------------------------------------------------------------


class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run_console(prog: str, argv: list[str]) -> tuple[int | None, str, str, list[str]]:
    """(exit status or None for an exception, stdout+stderr, traceback, warnings logged) of one console-script run."""
    from dflash_hf.cli.console import run_command

    log = _Log()
    logging.getLogger().addHandler(log)
    out = io.StringIO()
    tb = ""
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = run_command(prog, argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
    except BaseException:  # noqa: BLE001 - a raw crash is what this records
        code, tb = None, traceback.format_exc()
    finally:
        logging.getLogger().removeHandler(log)
    return code, out.getvalue(), tb, log.lines


def command_args(command: str, data: Path, run: Path, a: Assets, skip: bool) -> tuple[str, list[str]]:
    skip_args = ["--skip_bad_samples", "true"] if skip else []
    if command == "train":
        return "dflash-train", [
            "--target_name_or_path", str(a.target), "--train_data", str(data), "--output_dir", str(run / "out"),
            "--mask_token_id", str(MASK_TOKEN_ID), "--max_steps", "2", "--max_tokens", "600", "--report_to", "none",
            "--save_strategy", "no", "--logging_steps", "1", *skip_args,
        ]  # fmt: skip
    if command == "gen":
        return "dflash-generate-labels", [
            "--model", str(a.target), "--manifest", str(data), "--output", str(run / "labels.json"),
            "--max_new_tokens", "3", "--batch_size", "2", *skip_args,
        ]  # fmt: skip
    return "dflash-eval", [
        "--draft", str(a.draft), "--target", str(a.target), "--data", str(data), "--max_new_tokens", "3",
        "--output_json", str(run / "eval.json"),
    ]  # fmt: skip


def _finite_export(export: Path) -> bool:
    from safetensors.torch import load_file

    files = list(export.glob("*.safetensors"))
    return bool(files) and all(t.isfinite().all() for f in files for t in load_file(str(f)).values())


def _wrong_result(command: str, run: Path, expected_rows: int) -> str | None:
    """What is wrong with an exit-0 run's output, or None."""
    if command == "train":
        export = run / "out" / "draft"
        if not export.is_dir():
            return "no export"
        return None if _finite_export(export) else "non-finite export"
    if command == "gen":
        out = run / "labels.json"
        rows = len(out.read_text().splitlines()) if out.exists() else 0
        return None if rows == expected_rows else f"{rows} labelled rows, expected {expected_rows}"
    res = json.loads((run / "eval.json").read_text())
    if not res.get("outputs_identical", False):
        return "outputs differ"
    return None if res["prompts"] == expected_rows else f"{res['prompts']} prompts, expected {expected_rows}"


def _skips(output: str, warnings: list[str]) -> int:
    return sum("skipping bad sample" in w for w in warnings)


def classify(case: Case, command: str, skip: bool, root: Path, a: Assets) -> dict:
    """Run one case through one command; the outcome and the evidence."""
    run = root / f"{command}{'-skip' if skip else ''}"
    run.mkdir(parents=True)
    data = case.make(run, a)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    prog, argv = command_args(command, data, run, a, skip)
    extra = case.args.get(command, [])
    argv += extra(run, data) if callable(extra) else extra
    cwd = os.getcwd()
    os.chdir(run)  # a command run from a file name creates its marker here (relative to the working directory)
    try:
        code, output, tb, warnings = run_console(prog, argv)
    finally:
        os.chdir(cwd)
    lines = output.strip().splitlines() or [""]
    last = next((line for line in lines if ": error: " in line), lines[-1])[:300]
    markers = sorted(p.name for p in run.rglob(f"{MARKER}*"))
    changed = [p.name for p, b in before.items() if not p.exists() or p.read_bytes() != b]
    bad = case.bad_for(command)
    expected_rows = case.rows if case.rows is not None else len(a.good) + (0 if bad else 1)
    outcome, why = None, ""
    if markers:
        outcome, why = "silent-wrong", f"a program ran from a file name: {markers}"
    elif changed:
        outcome, why = "silent-wrong", f"input changed: {changed}"
    elif code is None:
        outcome, why = "raw crash", tb.strip().splitlines()[-1][:300]
    elif code == 2:
        outcome, why = "clear error", last
    elif code == 0:
        wrong = _wrong_result(command, run, expected_rows)
        skipped = _skips(output, warnings)
        if wrong:
            outcome, why = "silent-wrong", wrong
        elif bad and not skipped:
            outcome, why = "silent-wrong", "a bad row was used without a word"
        elif skipped:
            outcome, why = "skipped and counted", f"{skipped} skipped: {warnings[0][:200]}"
        else:
            outcome, why = "handled", ""
    else:
        outcome, why = "raw crash", f"exit {code}: {last}"
    expected = _expected(case, command, skip)
    return {
        "category": case.category,
        "case": case.name,
        "command": prog + (" --skip_bad_samples true" if skip else ""),
        "outcome": outcome,
        "expected": outcome in expected,
        "detail": why,
    }


def _expected(case: Case, command: str, skip: bool) -> set[str]:
    if not case.bad_for(command):
        return {"handled"}
    if case.category == "setting" or case.rows == 0:
        return {"clear error"}
    return {"skipped and counted", "clear error"} if skip else {"clear error"}


def build_assets(root: Path) -> Assets:
    """A tiny random Qwen3-ASR target, two synthetic utterances, and a draft exported by a 2-step `dflash-train`."""
    from dflash_hf.testing import tiny

    target = tiny.save_tiny_target(root / "target", "qwen3_asr", hidden_size=32, num_layers=4, num_heads=2,
                                   num_kv_heads=1)  # fmt: skip
    manifest = tiny.synthesize_speech(root / "speech", 2, seed=0, min_dur=0.5, max_dur=0.8)
    good = []
    for line in manifest.read_text().splitlines():
        row = json.loads(line)
        good.append({**row, "audio_filepath": str(manifest.parent / row["audio_filepath"])})
    a = Assets(root, target, root / "base" / "out" / "draft", good, Path(good[0]["audio_filepath"]))
    code, output, tb, _ = run_console(*command_args("train", manifest, root / "base", a, False))
    if code != 0:
        raise SystemExit(f"the baseline dflash-train run failed (exit {code}):\n{output[-2000:]}\n{tb}")
    return a


def run_cases(selected: list[Case], commands: tuple[str, ...], root: Path, progress: bool = True) -> list[dict]:
    assets = build_assets(root)
    results = []
    for i, case in enumerate(selected):
        for command in (c for c in case.commands if c in commands):
            for skip in (False, True) if command != "eval" else (False,):
                case_root = root / "cases" / f"{i:03d}"
                try:
                    result = classify(case, command, skip, case_root, assets)
                except Exception as e:  # noqa: BLE001 - the harness's own failure (writing the case): said, not hidden
                    result = {"category": case.category, "case": case.name, "command": command, "outcome": "raw crash",
                              "expected": False, "detail": f"harness: {type(e).__name__}: {e}"}  # fmt: skip
                results.append(result)
                if progress:
                    flag = "" if result["expected"] else "  <-- unexpected"
                    print(f"[{case.category}] {case.name} | {result['command']}: {result['outcome']}{flag}",
                          file=sys.__stderr__, flush=True)  # fmt: skip
    return results


def table(results: list[dict]) -> str:
    """Counts by category and outcome (markdown)."""
    counts = Counter((r["category"], r["outcome"]) for r in results)
    categories = sorted({r["category"] for r in results}, key=[r["category"] for r in results].index)
    head = "| category | runs | " + " | ".join(OUTCOMES) + " |"
    rows = [head, "|" + " --- |" * (len(OUTCOMES) + 2)]
    for cat in categories:
        n = sum(v for (c, _), v in counts.items() if c == cat)
        rows.append(f"| {cat} | {n} | " + " | ".join(str(counts[(cat, o)]) for o in OUTCOMES) + " |")
    total = Counter(r["outcome"] for r in results)
    rows.append(f"| all | {len(results)} | " + " | ".join(str(total[o]) for o in OUTCOMES) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--category", nargs="*", help="only these categories (audio, text, shape, file name, setting)")
    parser.add_argument("--commands", nargs="*", default=["train", "gen", "eval"], choices=["train", "gen", "eval"])
    parser.add_argument("--json", help="write every run's outcome here")
    parser.add_argument("--keep", help="keep the work directory here (default: a temporary one, removed)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    selected = [c for c in cases() if not args.category or c.category in args.category]
    if args.list:
        for c in selected:
            print(f"[{c.category}] {c.name} ({'bad' if c.bad else 'valid'}; {', '.join(c.commands)})")
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        results = run_cases(selected, tuple(args.commands), root)
    print(table(results))
    bad = [r for r in results if r["outcome"] in ("silent-wrong", "raw crash") or not r["expected"]]
    for r in bad:
        print(f"- [{r['category']}] {r['case']} | {r['command']}: {r['outcome']} ({r['detail']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "table": table(results)}, indent=2) + "\n")
    return 1 if any(r["outcome"] in ("silent-wrong", "raw crash") for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
