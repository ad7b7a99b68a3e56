"""The weight names vLLM's audio-LLM classes read, and the renaming that brings a transformers checkpoint to them.

transformers 5.17 to 5.22 save `Qwen2AudioForConditionalGeneration`, `AudioFlamingo3ForConditionalGeneration` and
`GlmAsrForConditionalGeneration` built from a config with the language model's base weights under a doubled prefix,
`language_model.model.model.` (`language_model.model.model.layers.0...`, `...model.model.embed_tokens.weight`; the
head stays `language_model.lm_head.weight`), and every version saves a model loaded from such a checkpoint the same
way. vLLM 0.34's classes read `language_model.model.` only (their weight loaders map no name of the language model):
what transformers 5.23 and later write for a model built from a config, and Qwen2-Audio's Hub layout. transformers
loads both. `SAVED_TO_VLLM` holds the renaming; the plugin's variants apply it to the weights as they stream into
vLLM's loader (`renamed_weights`), and `rewrite_for_vllm` to a saved checkpoint on disk. transformers' Voxtral is
saved the same way, but vLLM reads Mistral-format Voxtral only (the plugin refuses a transformers-saved one), so no
renaming serves it.

Imports neither vLLM nor anything of the package.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from safetensors import safe_open

logger = logging.getLogger(__name__)

DOUBLED_PREFIX = "language_model.model.model."
VLLM_PREFIX = "language_model.model."
# architecture -> (saved prefix, the prefix vLLM 0.34's class reads) for each renaming its checkpoints need
SAVED_TO_VLLM: dict[str, tuple[tuple[str, str], ...]] = {
    arch: ((DOUBLED_PREFIX, VLLM_PREFIX),)
    for arch in (
        "Qwen2AudioForConditionalGeneration",
        "AudioFlamingo3ForConditionalGeneration",
        "GlmAsrForConditionalGeneration",
    )
}
WHY = "the language model's doubled prefix transformers 5.17 to 5.22 save, which vLLM's class does not read"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def vllm_name(arch: str, name: str) -> str:
    """The name vLLM's class for `arch` reads for the saved weight `name` (`name` itself when no rule renames it)."""
    for saved, read in SAVED_TO_VLLM.get(arch, ()):
        if name.startswith(saved):
            return read + name[len(saved) :]
    return name


def _rules(arch: str) -> str:
    return ", ".join(f"{saved}* -> {read}*" for saved, read in SAVED_TO_VLLM[arch])


def _collision(new: str, old: str, other: str) -> ValueError:
    return ValueError(
        f"dflash_hf: renaming {old!r} to {new!r} (vLLM's layout) would collide with {other!r}, also in the "
        "checkpoint: it holds the language model in both of transformers' layouts and which one is meant cannot be "
        "told; save the model again, with save_pretrained, into an empty folder"
    )


def rename_map(arch: str, names: Iterable[str]) -> dict[str, str]:
    """Saved name -> vLLM's name for each of `names` that `SAVED_TO_VLLM` renames for `arch`. Raises ValueError when
    a new name is already among `names` (a checkpoint holding both layouts)."""
    names = list(names)
    renames = {name: new for name in names if (new := vllm_name(arch, name)) != name}
    kept = set(names) - set(renames)
    for old, new in renames.items():
        if new in kept:
            raise _collision(new, old, new)
    return renames


def renamed_weights(arch: str, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """`weights` ((name, tensor) pairs, as vLLM streams a checkpoint into a model's `load_weights`) with the names
    `SAVED_TO_VLLM` renames for `arch` renamed; once the stream ends, logs how many were and why. Raises ValueError
    when a renamed name is also in the stream under its new name."""
    renamed: dict[str, str] = {}  # new name -> saved name
    kept: set[str] = set()
    for name, tensor in weights:
        new = vllm_name(arch, name)
        if new != name:
            if new in kept:
                raise _collision(new, name, new)
            renamed[new] = name
        elif name in renamed:
            raise _collision(name, renamed[name], name)
        else:
            kept.add(name)
        yield new, tensor
    if renamed:
        logger.info("dflash_hf: renamed %d weight names of %s for vLLM, %s (%s)", len(renamed), arch, _rules(arch), WHY)


def _architecture(folder: Path) -> str:
    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"dflash_hf: {folder} has no config.json: give the folder save_pretrained wrote")
    archs = json.loads(config.read_text()).get("architectures") or []
    if len(archs) != 1 or archs[0] not in SAVED_TO_VLLM:
        raise ValueError(
            f"dflash_hf: {config} names the architectures {archs}: only a checkpoint of one of {sorted(SAVED_TO_VLLM)} "
            "has weight names to rewrite for vLLM"
        )
    return archs[0]


def _checkpoint_names(folder: Path, arch: str) -> tuple[dict[str, list[str]], dict | None]:
    """File name -> the weight names it holds, and the index (None for a single file). A shard may hold the index's
    names already renamed for vLLM (a rewrite stopped between two shards' replacements: the next one finishes it)."""
    single, index = folder / SINGLE_FILE, folder / INDEX_FILE
    if single.is_file() and index.is_file():
        raise ValueError(
            f"dflash_hf: {folder} holds both {SINGLE_FILE} and {INDEX_FILE}: remove the one save_pretrained did not "
            "write last"
        )
    if single.is_file():
        with safe_open(single, "pt") as f:
            return {SINGLE_FILE: list(f.keys())}, None
    if not index.is_file():
        raise FileNotFoundError(
            f"dflash_hf: {folder} holds no safetensors checkpoint ({SINGLE_FILE} or {INDEX_FILE}): give the folder "
            "save_pretrained wrote"
        )
    index_data = json.loads(index.read_text())
    files: dict[str, list[str]] = {}
    for name, file in index_data["weight_map"].items():
        files.setdefault(file, []).append(name)
    for file, names in files.items():
        if not (folder / file).is_file():
            raise FileNotFoundError(f"dflash_hf: {index} names {file}, which {folder} lacks")
        with safe_open(folder / file, "pt") as f:
            held = list(f.keys())
        if set(held) not in (set(names), {vllm_name(arch, name) for name in names}):
            raise ValueError(f"dflash_hf: {file} does not hold the weights {index} maps to it")
        files[file] = held
    return files, index_data


def _temporary(folder: Path, final: str) -> Path:
    """An empty temporary file beside `folder / final`."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{final}.", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rewrite_for_vllm(folder: str | os.PathLike) -> int:
    """Rename, in place, the weights of the checkpoint `save_pretrained` wrote in `folder` (`model.safetensors`, or
    the shards of `model.safetensors.index.json` and the index) to the names vLLM's class for its architecture reads
    (`SAVED_TO_VLLM`). Every changed file is written beside the old one first, then each replaces it in one step (the
    index last), so a failure while writing leaves the checkpoint as it was; the replacements are atomic per file
    only: a kill between those of two shards leaves shards of both layouts under the old index, and the next call
    finishes the rewrite. Returns how many names were renamed (0: the folder already has vLLM's layout and is left
    untouched). Raises when the folder holds no safetensors
    checkpoint, when its architecture has no renaming, or when a new name would collide with a name already there."""
    from safetensors.torch import save_file

    folder = Path(folder)
    arch = _architecture(folder)
    files, index = _checkpoint_names(folder, arch)
    renames = rename_map(arch, [name for names in files.values() for name in names])
    index_map = None if index is None else {vllm_name(arch, k): v for k, v in index["weight_map"].items()}
    if not renames and (index is None or index_map == index["weight_map"]):
        return 0
    staged: list[tuple[Path, Path]] = []  # (written, the file it replaces)
    try:
        for file, names in files.items():
            if not any(name in renames for name in names):
                continue
            staged.append((_temporary(folder, file), folder / file))
            with safe_open(folder / file, "pt") as f:
                tensors = {renames.get(name, name): f.get_tensor(name) for name in names}
                save_file(tensors, staged[-1][0], metadata=f.metadata())
            _fsync(staged[-1][0])
        if index is not None:
            index = {**index, "weight_map": index_map}
            staged.append((_temporary(folder, INDEX_FILE), folder / INDEX_FILE))
            staged[-1][0].write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            _fsync(staged[-1][0])
        for tmp, final in staged:  # the index last, once the shards it maps hold the new names
            os.replace(tmp, final)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    _fsync(folder)
    logger.info(
        "dflash_hf: renamed %d weight names of %s in %s, %s (%s)", len(renames), arch, folder, _rules(arch), WHY
    )
    return len(renames)


__all__ = [
    "DOUBLED_PREFIX",
    "SAVED_TO_VLLM",
    "VLLM_PREFIX",
    "rename_map",
    "renamed_weights",
    "rewrite_for_vllm",
    "vllm_name",
]
