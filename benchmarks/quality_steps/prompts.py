"""``data prompts``: chat prompts from the corpus, and text-only lhotse cuts for ``dflash-train``."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from .common import read_jsonl, stamp_ok, write_jsonl, write_stamp
from .corpus import build_corpus

PROMPT_TEMPLATES = (
    "Explain this verse in two sentences: {text}",
    "Paraphrase in plain modern English: {text}",
    "Continue this passage with three more sentences: {text}",
    "What is the main idea of this line? {text}",
)


@dataclass
class PromptArgs:
    train: int = 600
    eval: int = 24
    seed: int = 0


def build_prompts(cache: Path, a: PromptArgs) -> dict[str, Path]:
    """Chat prompts from the corpus: train.json (text-only manifest lines, prompt in ``context``, for
    dflash-generate-labels), eval.jsonl (``{"messages": ...}`` lines for dflash-eval, held-out sentences)."""
    corpus = read_jsonl(build_corpus(cache))
    root = cache / "data" / "prompts"
    paths = {"train": root / "train.json", "eval": root / "eval.jsonl"}
    stamp = root / "prompts.json"
    wanted = {"train": a.train, "eval": a.eval}
    if stamp_ok(stamp) and json.loads(stamp.read_text())["counts"] == wanted:
        return paths
    pools = {s: [r for r in corpus if r["split"] == s and len(r["text"].split()) <= 30] for s in ("train", "eval")}
    for split, n in wanted.items():
        if len(pools[split]) < n:
            raise ValueError(f"--{split} {n}: only {len(pools[split])} {split} sentences available")
        # One generator per split: the eval prompts do not change with the number of train prompts.
        pools[split] = random.Random(f"{a.seed}-{split}").sample(pools[split], n)
    rng = random.Random(a.seed)
    train = [
        {
            "id": f"p-{r['id']}",
            "text": "",
            "context": rng.choice(PROMPT_TEMPLATES).format(text=r["text"]),
            "source": r["source"],
        }
        for r in pools["train"]
    ]
    evals = [
        {
            "id": f"p-{r['id']}",
            "messages": [{"role": "user", "content": PROMPT_TEMPLATES[i % 4].format(text=r["text"])}],
        }
        for i, r in enumerate(pools["eval"])
    ]
    write_jsonl(paths["train"], train)
    write_jsonl(paths["eval"], evals)
    write_stamp(stamp, list(paths.values()), counts=wanted)
    return paths


def to_text_cuts(manifest: Path, out: Path) -> Path:
    """Text-only lhotse cuts from a text manifest (``dflash-train`` reads only NeMo-with-audio or lhotse files)."""
    from lhotse import CutSet
    from lhotse.cut import MonoCut
    from lhotse.supervision import SupervisionSegment

    cuts = []
    for r in read_jsonl(manifest):
        sup = SupervisionSegment(id=r["id"], recording_id=r["id"], start=0.0, duration=0.0, text=r["text"])
        custom = {k: v for k, v in r.items() if k not in ("id", "text", "lang")}
        cuts.append(MonoCut(id=r["id"], start=0.0, duration=0.0, channel=0, supervisions=[sup], custom=custom))
    CutSet.from_cuts(cuts).to_file(out)
    return out
