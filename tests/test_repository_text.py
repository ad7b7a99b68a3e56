"""The repository speaks of the software only: no tracked text file tells how the project was developed.

Docs are reference pages (how it works, how to use it, current results); how a figure was reached lives in git
history. This scans every tracked text file for the marks of a lab notebook (`PATTERNS`, by category).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|"
    "fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)
MACHINE = r"(?:machines?|gpus?|devices?|h100s?|h200s?|box(?:es)?)"
PATTERNS = {
    "a numbered work session": rf"\b(?:{ORDINALS})\s+(?:device\s+|work\s+)?sessions?\b",
    "a work session": "|".join(
        [
            r"\b(?:device|work|multi)[\s-]sessions?\b",
            r"(?<![a-z])sessions?[\s_-]?\d+",
            r"\b(?:this|next|previous|that|same|each|every|one)\s+session\b(?!\.sh)",
            r"\bthe\s+session's",
        ]
    ),
    "a team role": r"\bthe\s+lead\b",
    "an issue number": r"\bissues?\s+#?\d+",
    "a machine lent or borrowed": "|".join(
        [
            rf"\b(?:lent|borrowed)\b[^.\n]{{0,60}}\b{MACHINE}\b",
            rf"\b{MACHINE}\s+(?:was\s+|were\s+)?(?:not\s+)?(?:lent|borrowed)\b",
        ]
    ),
    "files carried to a machine": "|".join(
        [
            r"\bcarr(?:y|ies|ied|ying)\s+(?:back|home|groups?|as\s+(?:a\s+)?wheels?)\b",
            r"\b(?:wheels?|files?|drafts?|exports?|models?)\s+carried\b",
            r"\bbrought\s+home\b",
        ]
    ),
    "lent machine time": r"\bdevice\s+(?:minutes|machines?)\b",
    "a development machine's path": "|".join(
        [
            r"(?<![\w$.~-])/work/",
            r"/tmp/(?:bench|results|logs|lab\d*|dl|lb|rv|bring|stage_|helpers|venv)\b",
        ]
    ),
}
COMPILED = {what: re.compile(pattern, re.IGNORECASE) for what, pattern in PATTERNS.items()}
# this file names the patterns it looks for
ALLOWED_FILES = {"tests/test_repository_text.py"}


def development_speak(text: str) -> list[tuple[int, str, str]]:
    """`(line number, what, the matched text)` for every mark of development speak in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in COMPILED.items():
            match = pattern.search(line)
            if match:
                found.append((number, what, match.group(0)))
    return found


def tracked_text_files() -> list[str]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [name for name in listed.decode().split("\0") if name and name not in ALLOWED_FILES]


# Lines the scan must flag, kept as word tuples (joined by spaces) so that this file holds no such line itself.
FLAGGED = [
    ("measured in the", "fifteenth", "session"),
    ("the ninth", "device", "session's run"),
    ("h100_2026-12-05_session16_ab_rows.json",),
    ("written by", "the", "lead", "on one H200"),
    ("the goals of", "issue", "16"),
    ("no", "device", "machine was lent"),
    ("multi-GPU machines were not", "lent"),
    ("transformers 5.23", "carried", "as a wheel"),
    ("python x.py --target", "/work/cache/smollm2/hf"),
    ("--out", "/tmp/results/rows.json"),
]


@pytest.mark.parametrize("line", [" ".join(words) for words in FLAGGED])
def test_development_speak_is_found(line):
    assert development_speak(line), line


@pytest.mark.parametrize(
    "line",
    [
        "subprocess.Popen(cmd, start_new_session=True)",
        "scores already carry the temperature",
        "the frames carry the encoder's positions",
        "positions do not carry over between ranks",
        "pytorch/pytorch#197077 (a reduction with an RMSNorm-style epilogue)",
        "leading padding moves to the end",
        "a tokenizer used by two threads fails with 'Already borrowed'",
        "python scripts/check_objective_parity.py --save /tmp/before.pt",
        "bash benchmarks/device/session.sh setup",
    ],
)
def test_plain_software_text_passes(line):
    assert not development_speak(line), development_speak(line)


def test_no_tracked_file_speaks_of_how_the_project_was_developed():
    hits = []
    for name in tracked_text_files():
        path = REPO_ROOT / name
        if not path.is_file():
            continue  # deleted in the working tree, not yet committed
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (figures)
        for number, what, matched in development_speak(data.decode("utf-8", errors="replace")):
            hits.append(f"{name}:{number}: {what}: {matched!r}")
    assert not hits, f"{len(hits)} lines speak of how the project was developed:\n" + "\n".join(hits)
