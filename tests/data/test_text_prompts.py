"""Text prompts of JSON lines (`dflash-eval --data` for a text target): counted, checked and tokenized."""

from __future__ import annotations

import gzip

from dflash_hf.data.text_prompts import count_records, first_record, text_prompts
from dflash_hf.testing import tiny


def test_gzipped_text_prompts_are_read_like_plain_ones(tmp_path):
    """--data may be gzipped (detected by content, as manifests are): counting, the kind check and the prompts
    read the same rows."""
    lines = b'{"prompt": "hello there"}\n\n{"prompt": "two"}\n'
    plain, packed = tmp_path / "p.jsonl", tmp_path / "p.data"
    plain.write_bytes(lines)
    packed.write_bytes(gzip.compress(lines))
    tok = tiny.build_tokenizer()
    for path in (plain, packed):
        assert count_records(str(path)) == 2
        assert first_record(str(path)) == {"prompt": "hello there"}
        lengths = [p["input_ids"].shape[1] for p in text_prompts(str(path), tok)]
        assert lengths == [len(tok("hello there")["input_ids"]), len(tok("two")["input_ids"])]
