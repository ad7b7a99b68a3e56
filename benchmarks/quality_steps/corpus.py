"""``data corpus``: English sentences from Debian text packages (Bible, fortunes, Fish Fillets), 1 in 20 held out."""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

from .common import stamp_ok, write_jsonl, write_stamp

FILLETS_LINE = re.compile(r'dialogId\("[^"]*",\s*"[^"]*",\s*"((?:[^"\\]|\\.)*)"\)')


def bible_verses() -> list[str]:
    out = subprocess.run(["bible", "-l0", "gen1:1-rev22:21"], check=True, capture_output=True, text=True).stdout
    return [m.group(1) for m in re.finditer(r"^\s*\d+ (.+)$", out, flags=re.M)]


def fortunes(root: Path = Path("/usr/share/games/fortunes")) -> list[str]:
    out = []
    for path in sorted(root.iterdir()):
        if path.suffix or not path.is_file() or path.name.endswith("-o"):
            continue
        for entry in path.read_text(errors="replace").split("\n%\n"):
            text = " ".join(entry.split())
            if text and "--" not in text:  # attributed quotes read badly as speech
                out.append(text)
    return out


def fillets_lines(root: Path = Path("/usr/share/games/fillets-ng/script")) -> list[str]:
    out = []
    for path in sorted(root.glob("*/dialogs_en.lua")):
        out += [m.group(1).replace("\\", "") for m in FILLETS_LINE.finditer(path.read_text(errors="replace"))]
    return out


def clean_sentence(text: str) -> str | None:
    """Plain readable English of 6-40 words, ASCII after quote normalization; None otherwise."""
    text = text.replace("\u2019", "'").replace("\u2018", "'").replace("\u201c", '"').replace("\u201d", '"')
    text = " ".join(text.split())
    if not text.isascii() or re.search(r"[<>{}\[\]|_=#@*\\~^`]|https?:|\d{3,}", text):
        return None
    if not 6 <= len(text.split()) <= 40:
        return None
    return text


def build_corpus(cache: Path) -> Path:
    """sentences.jsonl: {"id", "source", "text", "split"}; 'eval' = held out (1 in 20, by a hash of the text)."""
    path = cache / "data" / "corpus" / "sentences.jsonl"
    stamp = path.with_name("corpus.json")
    if stamp_ok(stamp):
        return path
    rows, seen, rejected = [], set(), {}
    for source, texts in (("bible", bible_verses()), ("fortunes", fortunes()), ("fillets", fillets_lines())):
        kept = 0
        for text in texts:
            clean = clean_sentence(text)
            if clean is None or clean in seen:
                continue
            seen.add(clean)
            split = "eval" if int(hashlib.sha1(clean.encode()).hexdigest(), 16) % 20 == 0 else "train"
            rows.append({"id": f"{source}-{kept:06d}", "source": source, "text": clean, "split": split})
            kept += 1
        rejected[source] = len(texts) - kept
        print(f"corpus {source}: {len(texts)} entries, {kept} kept ({len(texts) - kept} too short/long/odd/dup)")
    write_jsonl(path, rows)
    write_stamp(stamp, [path], rejected=rejected, counts={s: sum(r["source"] == s for r in rows) for s in rejected})
    return path
