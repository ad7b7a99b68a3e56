"""Draft checkpoints in and out: strict warm start, model card, push to the Hub.

- :func:`load_draft_strict`: weights-only warm start from a draft export (DESIGN 5). Every missing,
  unexpected or wrongly shaped tensor is an error naming it; quantized exports are refused.
- :func:`export_draft`: the checkpoint contract, LoRA merged (serving needs nothing new).
- :func:`convert_dflash_to_dflash2`: a DFlash2 draft at identity init from a DFlash export.
- :func:`push_draft_to_hub`: upload exactly the serving files plus a generated model card
  (:func:`build_model_card`); `dry_run_dir` writes that folder instead, offline.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .adaptation import is_peft_model, merged_draft, peft_model
from .configuration_dflash import ARCHITECTURES, DFlashConfig
from .modeling_dflash import DFlash2DraftModel, DFlashDraftModel

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# Files a draft export may hold besides its weights; anything else is noted and ignored on load.
EXPORT_FILES = ("config.json", "configuration_dflash.py", "modeling_dflash.py", "README.md", "generation_config.json")
# safetensors dtype codes of full-precision exports; anything else (U8, I8, F8_*, I32 ...) is quantized/packed.
FLOAT_DTYPES = ("F32", "BF16", "F16")
QUANT_CONFIG_KEYS = ("quantization_config", "compression_config")
QUANT_FILES = ("hf_quant_config.json", "quant_config.json", "quantize_config.json")


# ------------------------------------------------------------------------------------------------
# Warm start: strict weights-only loading
# ------------------------------------------------------------------------------------------------
def _quantized_error(path: Path, reason: str) -> ValueError:
    return ValueError(
        f"{path} is a quantized draft export ({reason}); warm start needs a BF16 or FP32 export of the "
        "draft (save the unquantized draft with save_pretrained, or dequantize it first)"
    )


def resolve_draft_dir(path: str | Path) -> Path:
    """A local export directory, or a Hub repo id already in the local cache (no download)."""
    local = Path(path)
    if local.is_dir():
        return local
    if local.exists():
        raise NotADirectoryError(f"init_from_pretrained={str(path)!r} is a file; give the draft export directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(path), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as err:
        raise FileNotFoundError(
            f"init_from_pretrained={str(path)!r} is neither a local directory nor a Hub repo in the local cache; "
            f"download it first (`hf download {path}`) or pass the export directory"
        ) from err


def _read_json(file: Path) -> dict:
    """A JSON object from `file`; invalid JSON is an error naming the file and line."""
    try:
        raw = json.loads(file.read_text())
    except UnicodeDecodeError as err:
        raise ValueError(f"{file} is not UTF-8 text ({err}); it is not a DFlash draft export's JSON") from err
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{file} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); restore or re-export it"
        ) from err
    if not isinstance(raw, dict):
        raise ValueError(f"{file} holds a JSON {type(raw).__name__}, not an object; restore or re-export it")
    return raw


def _read_draft_config(directory: Path, block_size: int | None) -> DFlashConfig:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory} has no config.json; it is not a DFlash draft export")
    raw = _read_json(config_file)
    for key in QUANT_CONFIG_KEYS:
        if raw.get(key):
            method = raw[key].get("quant_method", "?") if isinstance(raw[key], dict) else "?"
            raise _quantized_error(directory, f"config.json has `{key}` (quant_method={method})")
    for name in QUANT_FILES:
        if (directory / name).is_file():
            raise _quantized_error(directory, f"it ships {name}")
    archs = raw.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES.values()]
    if len(known) != 1:
        raise ValueError(
            f"{config_file}: `architectures` is {archs}; a draft export names exactly one of "
            f"{sorted(ARCHITECTURES.values())}"
        )
    dflash_config = raw.get("dflash_config")
    if not isinstance(dflash_config, dict):
        raise ValueError(f"{config_file} has no `dflash_config` object; it is not a DFlash draft export")
    saved_block = raw.get("block_size", dflash_config.get("block_size"))
    if saved_block is None:
        raise ValueError(
            f"{config_file} has neither top-level `block_size` nor `dflash_config.block_size`; "
            "pass block_size explicitly"
        )
    config = DFlashConfig.from_dict({**raw, "block_size": int(saved_block)})
    if block_size is not None and block_size != config.block_size:
        logger.info("Warm start: block_size %d (saved) -> %d (weights do not depend on it)", saved_block, block_size)
        config.set_block_size(block_size)
    config.validate_dflash()
    return config


def _weight_files(directory: Path) -> list[Path]:
    index = directory / WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no `weight_map`; the sharded export is incomplete")
        shards = sorted(set(weight_map.values()))
        absent = [s for s in shards if not (directory / s).is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists shards that are not in {directory}: {absent}")
        return [directory / s for s in shards]
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return [single]
    others = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    hint = f" (found {others}: re-export with save_pretrained(safe_serialization=True))" if others else ""
    raise FileNotFoundError(f"{directory} has no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}{hint}")


def _note_extra_files(directory: Path, weight_files: list[Path]) -> None:
    known = set(EXPORT_FILES) | {WEIGHTS_INDEX_NAME} | {p.name for p in weight_files}
    extra = sorted(p.name for p in directory.iterdir() if p.name not in known and not p.name.startswith("."))
    if extra:
        logger.warning("Warm start from %s: ignoring non-weight files %s", directory, extra)


def _open_weights(file: Path):
    """`safe_open` of one weight file; a truncated or corrupt file is an error naming it."""
    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as err:
        raise ValueError(
            f"{file} is not a readable safetensors file ({err}); it is truncated or corrupt: copy or export "
            "the draft again"
        ) from err


def _weight_dtypes(directory: Path, weight_files: list[Path]) -> dict[str, str]:
    """name -> safetensors dtype of every tensor (headers only); quantized/packed dtypes are refused."""
    dtypes: dict[str, str] = {}
    where: dict[str, Path] = {}
    packed = []
    for file in weight_files:
        with _open_weights(file) as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                if dtype not in FLOAT_DTYPES:
                    packed.append(f"{name} ({dtype})")
                if name in dtypes:
                    raise ValueError(f"tensor {name!r} appears in both {where[name].name} and {file.name}")
                dtypes[name], where[name] = dtype, file
    if packed:
        more = f" and {len(packed) - 5} more" if len(packed) > 5 else ""
        raise _quantized_error(directory, f"tensors in packed/quantized dtypes: {', '.join(packed[:5])}{more}")
    return dtypes


def _read_state_dict(directory: Path, weight_files: list[Path]) -> dict[str, torch.Tensor]:
    """All tensors of the export; a non-float (quantized/packed) tensor is refused before any is loaded."""
    _weight_dtypes(directory, weight_files)
    state: dict[str, torch.Tensor] = {}
    for file in weight_files:
        with _open_weights(file) as f:
            for name in f.keys():
                try:
                    state[name] = f.get_tensor(name)
                except SafetensorError as err:
                    raise ValueError(f"{file}: tensor {name!r} cannot be read ({err}); export the draft again") from err
    return state


def check_draft_export(path: str | Path, block_size: int | None = None) -> DFlashConfig:
    """Cheap checks of a warm-start export before anything expensive runs: the directory, `config.json`
    (valid JSON, a DFlash config) and the weight files' headers (readable, not quantized). Its config."""
    directory = resolve_draft_dir(path)
    config = _read_draft_config(directory, block_size)
    _weight_dtypes(directory, _weight_files(directory))
    return config


def draft_class_for(config: DFlashConfig) -> type[DFlashDraftModel]:
    """`DFlashDraftModel` or `DFlash2DraftModel`, from `config.architectures`."""
    return DFlash2DraftModel if config.variant == "dflash2" else DFlashDraftModel


def check_warm_start(
    config: DFlashConfig,
    *,
    variant: str,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    vocab_size: int | None = None,
    source: str = "init_from_pretrained",
) -> None:
    """The warm-started draft keeps its architecture, taps and mask id: explicit settings must agree.
    `vocab_size`: the target's embedding rows; a draft trained against another vocabulary is refused."""
    if config.variant != variant:
        raise ValueError(
            f"{source} is a {ARCHITECTURES[config.variant]} but variant={variant!r}; set variant: {config.variant} "
            "(a warm start keeps the saved architecture)"
        )
    if target_layer_ids is not None and list(target_layer_ids) != config.target_layer_ids:
        raise ValueError(
            f"target_layer_ids={list(target_layer_ids)} differs from the warm-started draft's taps "
            f"{config.target_layer_ids}; drop target_layer_ids (fc.weight is tied to the saved taps)"
        )
    if mask_token_id is not None and mask_token_id != config.mask_token_id:
        raise ValueError(
            f"mask_token_id={mask_token_id} differs from the warm-started draft's {config.mask_token_id}; "
            "drop mask_token_id or use the saved one"
        )
    if vocab_size is not None and config.vocab_size != vocab_size:
        raise ValueError(
            f"{source} was trained against a target with vocab_size {config.vocab_size}, but this target's "
            f"embedding has {vocab_size} rows; warm start from a draft of this target (same tokenizer and "
            "embedding), or train a new draft"
        )


def load_draft_strict(path: str | Path, block_size: int | None = None) -> DFlashDraftModel:
    """Weights-only warm start from a draft export (a `save_pretrained` directory or a cached Hub id).

    Strict: every missing, unexpected or wrongly shaped tensor is named in one error. Quantized exports
    (a `quantization_config`, or tensors in packed/quantized dtypes) are refused. `block_size`, when
    given, replaces the saved block size (no weight depends on it) and is what a later export writes.
    Returns the draft in float32 (or the saved float dtype's values cast to float32), in train mode.
    """
    directory = resolve_draft_dir(path)
    config = _read_draft_config(directory, block_size)
    weight_files = _weight_files(directory)
    _note_extra_files(directory, weight_files)
    state = _read_state_dict(directory, weight_files)
    model = draft_class_for(config)(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs draft {tuple(expected[k].shape)}"
        for k in set(expected) & set(state)
        if state[k].shape != expected[k].shape
    )
    if missing or unexpected or wrong:
        parts = [f"{label} ({len(names)}): {names}" for label, names in (
            ("missing tensors", missing), ("unexpected tensors", unexpected), ("wrongly shaped tensors", wrong)
        ) if names]
        raise ValueError(
            f"strict warm start from {directory} failed for {config.architectures[0]} "
            f"(hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_taps} taps); "
            + "; ".join(parts)
        )
    model.load_state_dict(state, strict=True)
    return model.train()


# ------------------------------------------------------------------------------------------------
# Export and conversion
# ------------------------------------------------------------------------------------------------
EXPORT_FILE_MODE = 0o644  # readable by a serving process running as another user


def make_readable(export_dir: Path) -> None:
    """Give every file of an export mode 0644 (safetensors writes weights as 0600)."""
    for path in export_dir.iterdir():
        if path.is_file():
            path.chmod(EXPORT_FILE_MODE)


def _fresh_copy(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """A CPU copy of `model` (a draft or its LoRA `PeftModel`) holding `state_dict`, built from the config,
    so it works for parameter-sharded (FSDP) models whose own tensors are only shards."""
    peft = is_peft_model(model)
    base = model.get_base_model() if peft else model
    config = copy.deepcopy(base.config)
    fresh = draft_class_for(config)(config)
    if peft:
        fresh = peft_model(fresh, copy.deepcopy(model.peft_config[model.active_adapter]))
    dtype = next(t.dtype for t in state_dict.values() if t.is_floating_point())
    fresh.to(dtype).load_state_dict(state_dict, strict=True)
    return fresh


def export_draft(model: nn.Module, export_dir: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the draft in the checkpoint contract (DESIGN 5): config.json, model.safetensors and the
    remote-code files. A LoRA `PeftModel` is merged first (on a copy), so the export is a plain draft.
    `state_dict`: the model's full state dict gathered elsewhere (FSDP), exported instead of its own tensors."""
    draft = merged_draft(model if state_dict is None else _fresh_copy(model, state_dict))
    if not isinstance(draft, DFlashDraftModel):
        raise TypeError(f"export_draft needs a DFlash draft (or its PeftModel), got {type(draft).__name__}")
    export_dir = Path(export_dir)
    draft.save_pretrained(export_dir, safe_serialization=True)
    make_readable(export_dir)
    return export_dir


def convert_dflash_to_dflash2(
    source: str | Path,
    out_dir: str | Path,
    *,
    conv_kernel_size: int = 2,
    conv_group_size: int = 16,
    selector_rank: int = 256,
    selector_top_k: int = 16,
    seed: int = 0,
) -> Path:
    """Bootstrap a DFlash2 draft from a DFlash export (DESIGN 4 init): every DFlash tensor copied
    unchanged, identity convolutions, zero successor codebook, seeded N(0, 0.02) predecessor codebook.
    The result computes exactly the source's hidden states and greedy proposals, is written in the
    source's float dtype, and loads strictly. Returns `out_dir`."""
    source_model = load_draft_strict(source)
    config = copy.deepcopy(source_model.config)
    if config.variant != "dflash":
        raise ValueError(f"{source} is already a {ARCHITECTURES[config.variant]}; conversion needs a DFlash export")
    config.architectures = [ARCHITECTURES["dflash2"]]
    config.dflash_config.update(
        conv_kernel_size=conv_kernel_size,
        conv_group_size=conv_group_size,
        selector_rank=selector_rank,
        selector_top_k=selector_top_k,
    )
    config.validate_dflash()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = draft_class_for(config)(config)
    missing, unexpected = model.load_state_dict(source_model.state_dict(), strict=False)
    new_only = ("attention_conv.", "mlp_conv.", "candidate_selector.")
    foreign = [k for k in missing if not any(part in k for part in new_only)]
    if unexpected or foreign:
        raise ValueError(f"{source}: tensors do not map onto DFlash2 (unexpected {unexpected}, unfilled {foreign})")
    dtype = config.dtype if config.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    out_dir = Path(out_dir)
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    make_readable(out_dir)
    return out_dir


# ------------------------------------------------------------------------------------------------
# Publishing: model card and push
# ------------------------------------------------------------------------------------------------
@dataclass
class DraftCardInfo:
    """What the model card says beyond the draft's own config (taps, mask id, block size, variant).

    Args:
        target_id: Hub id (or name) of the frozen target the draft was trained against.
        target_revision: the target's revision (commit or tag) the draft was trained against.
        data_summary: training data in a sentence or two (sources, hours or samples, label source).
        tau_est: validation expected acceptance length (`eval_tau_est` of `DFlashTrainer.evaluate`).
        tau: measured acceptance length of speculative decoding (`speculative_generate(...).tau`).
        eval_name: what tau_est / tau were measured on.
        license: license id for the card metadata (the target's license usually applies).
    """

    target_id: str
    target_revision: str | None = None
    data_summary: str = ""
    tau_est: float | None = None
    tau: float | None = None
    eval_name: str | None = None
    license: str | None = None

    def validate(self, block_size: int) -> None:
        if not self.target_id:
            raise ValueError("card_info.target_id is empty: give the Hub id of the target the draft accelerates")
        for name in ("tau_est", "tau"):
            value = getattr(self, name)
            if value is not None and not 1.0 <= value <= block_size:
                raise ValueError(
                    f"card_info.{name}={value} is outside [1, block_size={block_size}]: acceptance length counts "
                    "accepted draft tokens plus the bonus token"
                )


def _fmt(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.3f}"


def build_model_card(config: DFlashConfig, repo_id: str, info: DraftCardInfo) -> str:
    """README.md of a published draft: metadata, draft facts, data, validation tau, how to serve it."""
    variant = ARCHITECTURES[config.variant]
    target = f"`{info.target_id}`" + (f" (revision `{info.target_revision}`)" if info.target_revision else "")
    revision_arg = f', revision="{info.target_revision}"' if info.target_revision else ""
    revision_flag = f" --revision {info.target_revision}" if info.target_revision else ""
    meta = ["---", "library_name: transformers", f"base_model: {info.target_id}"]
    if info.license:
        meta.append(f"license: {info.license}")
    meta += ["tags:", "- dflash", "- speculative-decoding", "- draft-model", "- dflash_hf", "---"]
    rows = [
        ("variant", f"{'DFlash2' if config.variant == 'dflash2' else 'DFlash'} (`{variant}`)"),
        ("target", target),
        ("block size", str(config.block_size)),
        ("mask token id", str(config.mask_token_id)),
        ("target layer taps", f"{config.target_layer_ids} of {config.num_target_layers} decoder layers"),
        ("draft layers / hidden size", f"{config.num_hidden_layers} / {config.hidden_size}"),
    ]
    if config.variant == "dflash2":
        dc = config.dflash_config
        rows.append(("convolution (kernel, group)", f"{dc['conv_kernel_size']}, {dc['conv_group_size']}"))
        rows.append(("path selector (rank, top-k)", f"{dc['selector_rank']}, {dc['selector_top_k']}"))
    header = "\n".join(meta)
    draft_table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    measured_on = f" ({info.eval_name})" if info.eval_name else ""
    spec_tokens = config.block_size - 1
    return f"""{header}

# {repo_id.split("/")[-1]}

A {variant} block-diffusion speculative-decoding draft for `{info.target_id}`, trained with `dflash_hf`.
Each step it proposes up to {spec_tokens} tokens from features of the frozen target, which verifies them:
outputs are exactly the target's (greedy) or follow its distribution (sampling).

## Draft

| field | value |
| --- | --- |
{draft_table}

The checkpoint holds draft weights only: no embedding and no lm_head. Block ids are embedded with the
target's `embed_tokens`, and draft logits come from the target's `lm_head`.

## Training data

{info.data_summary or "Not described."}

## Validation

| metric{measured_on} | value |
| --- | --- |
| tau_est (expected acceptance length, block {config.block_size}) | {_fmt(info.tau_est)} |
| tau (measured acceptance length of speculative decoding) | {_fmt(info.tau)} |

Acceptance length = accepted draft tokens + 1 bonus token per draft/verify cycle, in [1, {config.block_size}].

## Serving

The files follow the published DFlash draft contract (`config.json` with `block_size` and `dflash_config`,
`model.safetensors`, remote code), so engines that load DFlash drafts load this one unchanged. A
vLLM-style speculative config:

```bash
vllm serve {info.target_id}{revision_flag} \\
  --speculative-config '{{"method": "dflash", "model": "{repo_id}", "num_speculative_tokens": {spec_tokens}}}'
```

SGLang-style:

```bash
python -m sglang.launch_server --model-path {info.target_id}{revision_flag} \\
  --speculative-algorithm DFLASH --speculative-draft-model-path {repo_id} \\
  --speculative-num-draft-tokens {config.block_size}
```

With `dflash_hf` (without it: `AutoModel.from_pretrained("{repo_id}", trust_remote_code=True)`):

```python
from transformers import AutoModelForCausalLM, AutoProcessor  # or the target's audio-LLM class
from dflash_hf import {variant}, speculative_generate

draft = {variant}.from_pretrained("{repo_id}")
target = AutoModelForCausalLM.from_pretrained("{info.target_id}"{revision_arg})
processor = AutoProcessor.from_pretrained("{info.target_id}"{revision_arg})
inputs = processor(...)  # one prompt (text and/or audio), exactly as for target.generate
out = speculative_generate(draft, target, max_new_tokens=256, **inputs)
print(out.sequences, sum(out.acceptance_lengths) / len(out.acceptance_lengths))
```
"""


def _stage_upload(export_dir: Path, staging: Path, config: DFlashConfig, repo_id: str, info: DraftCardInfo) -> None:
    """Copy exactly the files serving needs into `staging`, plus the generated README.md."""
    weight_files = _weight_files(export_dir)
    index = [export_dir / WEIGHTS_INDEX_NAME] if (export_dir / WEIGHTS_INDEX_NAME).is_file() else []
    code = [export_dir / name for name in ("configuration_dflash.py", "modeling_dflash.py")]
    absent = [p.name for p in code if not p.is_file()]
    if absent or "auto_map" not in json.loads((export_dir / "config.json").read_text()):
        raise FileNotFoundError(
            f"{export_dir} lacks remote code ({absent or 'config.json auto_map'}) that lets AutoModel load the "
            "draft; re-export it with dflash_hf.hub.export_draft (save_pretrained)"
        )
    files = [export_dir / "config.json", *code, *index, *weight_files]
    skipped = sorted({p.name for p in export_dir.iterdir()} - {p.name for p in files} - {"README.md"})
    if skipped:
        logger.warning("push_draft_to_hub: not uploading %s from %s", skipped, export_dir)
    staging.mkdir(parents=True, exist_ok=True)
    for p in files:
        shutil.copy2(p, staging / p.name)
    (staging / "README.md").write_text(build_model_card(config, repo_id, info))


def push_draft_to_hub(
    export_dir: str | Path,
    repo_id: str,
    *,
    card_info: DraftCardInfo,
    dry_run_dir: str | Path | None = None,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Publish a draft export with a generated model card.

    The export is first validated as a strict warm start would (contract tensors only, no quantized
    weights). Uploaded: config.json, the weights, configuration_dflash.py, modeling_dflash.py, README.md;
    other files of the export dir are not. With `dry_run_dir`, the exact folder is written there and
    nothing touches the network. Returns the commit URL (or the dry-run folder).
    """
    from huggingface_hub import HfApi
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(repo_id)
    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise FileNotFoundError(f"export_dir={str(export_dir)!r} is not a directory; run export_draft first")
    config = load_draft_strict(export_dir).config
    card_info.validate(config.block_size)
    if dry_run_dir is not None:
        dry_run_dir = Path(dry_run_dir)
        if dry_run_dir.exists() and any(dry_run_dir.iterdir()):
            raise FileExistsError(f"dry_run_dir={str(dry_run_dir)!r} is not empty; give a new or empty folder")
        _stage_upload(export_dir, dry_run_dir, config, repo_id, card_info)
        return str(dry_run_dir)
    api = HfApi(token=token)
    with tempfile.TemporaryDirectory() as tmp:
        _stage_upload(export_dir, Path(tmp), config, repo_id, card_info)
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=tmp,
            repo_type="model",
            commit_message=commit_message or f"Upload {ARCHITECTURES[config.variant]} for {card_info.target_id}",
        )
    return commit.commit_url


__all__ = [
    "load_draft_strict",
    "check_warm_start",
    "check_draft_export",
    "export_draft",
    "resolve_draft_dir",
    "draft_class_for",
    "convert_dflash_to_dflash2",
    "DraftCardInfo",
    "build_model_card",
    "push_draft_to_hub",
]
