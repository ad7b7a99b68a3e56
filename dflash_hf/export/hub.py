"""Publishing a draft export: the generated model card and the push to the Hub.

- :func:`push_draft_to_hub`: upload exactly the serving files plus a generated model card
  (:func:`build_model_card`); `dry_run_dir` writes that folder instead, offline.

Loading and export live in `dflash_hf.export.drafts`, the conversion in `dflash_hf.export.conversion` (all of them
exported by `dflash_hf.export`).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from dflash_hf.export.drafts import WEIGHTS_INDEX_NAME, load_draft_strict, weight_file_paths
from dflash_hf.export.training_record import TRAINING_RECORD_FILE
from dflash_hf.models.configuration_dflash import ARCHITECTURES, DFlashConfig
from dflash_hf.serving.vllm_plugin import HIDDEN_STATE_VARIANTS, refusal
from dflash_hf.targets.families.base import config_field
from dflash_hf.targets.families.qwen3_asr import missing_vllm_serving_fields

logger = logging.getLogger(__name__)


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
        target_architecture: the target's `config.architectures[0]`: which engine serves the draft with it
            (`serving_status`); None: the card names no engine.
        target_text_model_type: the `model_type` of the target's text model (`text_config`), for the audio LLMs
            whose vLLM class builds one fixed text model.
        target_vllm_fields_missing: the audio-config fields vLLM's Qwen3-ASR reads that the target's config lacks
            (`qwen3_asr.missing_vllm_serving_fields`): vLLM cannot build such a target, so the card gives no command.
    """

    target_id: str
    target_revision: str | None = None
    data_summary: str = ""
    tau_est: float | None = None
    tau: float | None = None
    eval_name: str | None = None
    license: str | None = None
    target_architecture: str | None = None
    target_text_model_type: str | None = None
    target_vllm_fields_missing: tuple[str, ...] = ()

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


_CONTRACT_SERVING = (
    "The files follow the published DFlash draft contract (`config.json` with `block_size`, `dflash_config` and\n"
    "`is_causal: false`, `model.safetensors`, remote code). vLLM takes the block from `num_speculative_tokens`\n"
    "(block size - 1; it never reads `block_size`, and a DFlash2 draft's convolution spans\n"
    "`1 + num_speculative_tokens` slots)."
)
# Target kinds with a measured serving row (docs/SERVING.md): the card prints their command. Others say what is known.
MEASURED_SERVING = {"text": "vLLM 0.34", "qwen3_asr": "vLLM 0.34", "plugin": "vLLM 0.34 with the dflash_hf plugin"}
# the text-target architectures with a measured vLLM row (docs/SERVING.md: a Qwen3 text target, DFlash and DFlash2)
MEASURED_TEXT_ARCHITECTURES = ("Qwen3ForCausalLM",)
QWEN3_ASR = "Qwen3ASRForConditionalGeneration"
# the variants measured in vLLM with a Qwen3-ASR target (docs/SERVING.md: the demo's tiny one and a 1.7B-shaped one)
MEASURED_QWEN3_ASR_VARIANTS = ("dflash",)
# the plugin's (architecture, variant) pairs measured in vLLM (docs/SERVING.md: a Qwen2-Audio speech LLM whose text
# model is a Qwen2, its DFlash2 draft); the plugin refuses the text models vLLM's class would build differently
MEASURED_PLUGIN_PAIRS = (("Qwen2AudioForConditionalGeneration", "dflash2"),)
_MEASURED_WHERE = "a measured pair: dflash_hf's docs/SERVING.md"  # where the card says a measured pair is
# how the card names each engine of `serving_commands`
ENGINE_NAMES = {"vllm": "vLLM"}

_ENCODER_CONTEXT_SERVING = (
    "**Outside the published DFlash contract**: this draft also cross-attends to the target's encoder frames\n"
    "(`dflash_config.encoder_hidden_size`, `--draft_encoder_context`). Its architecture name says so, and serving\n"
    "engines refuse it (an engine that dropped the tensors it does not know would serve it wrong). Decode it with\n"
    "`dflash_hf` (`speculative_generate` or `target.generate(custom_generate=...)`)."
)


def target_serving_facts(target_config) -> dict[str, str | None]:
    """`DraftCardInfo`'s target fields from the target's config: a transformers config or its `config.json` dict."""
    return {
        "target_architecture": (config_field(target_config, "architectures") or [None])[0],
        "target_text_model_type": config_field(config_field(target_config, "text_config") or {}, "model_type"),
        "target_vllm_fields_missing": tuple(missing_vllm_serving_fields(target_config)),
    }


def serving_status(config: DFlashConfig, info: DraftCardInfo) -> tuple[str | None, str]:
    """Which target kind of `MEASURED_SERVING` the draft's target is (None: no measured row), and the sentence the
    card says about serving it."""
    arch = info.target_architecture
    if not config.in_published_contract:
        return None, "No serving engine loads this draft (outside the published DFlash contract)."
    if arch is None:
        return None, "The target's architecture was not given, so this card names no engine that serves the draft."
    if arch in MEASURED_TEXT_ARCHITECTURES:
        return "text", f"{MEASURED_SERVING['text']} serves this draft with its text target ({_MEASURED_WHERE})."
    if arch == QWEN3_ASR:
        fields = (
            "vLLM builds the target only when its `audio_config` carries the fields\n"
            "`dflash_hf.targets.families.qwen3_asr.add_vllm_serving_fields` writes (dflash-train warns when they are\n"
            "missing)."
        )
        if info.target_vllm_fields_missing:
            return None, (
                "vLLM 0.34 cannot build this target: its `audio_config` lacks "
                f"{', '.join(info.target_vllm_fields_missing)}\n(`dflash_hf.targets.families.qwen3_asr."
                "add_vllm_serving_fields` writes them; save the target again), so no command is given here."
            )
        if config.variant in MEASURED_QWEN3_ASR_VARIANTS:
            served = f"{MEASURED_SERVING['qwen3_asr']} serves this draft with its Qwen3-ASR target ({_MEASURED_WHERE})."
            return "qwen3_asr", f"{served}\n{fields}"
        return None, (
            "vLLM 0.34 serves DFlash drafts of Qwen3-ASR targets, but a DFlash2 draft with one has not been measured\n"
            f"yet, so no command is given here. {fields}"
        )
    if arch in HIDDEN_STATE_VARIANTS:
        reason = refusal(arch, SimpleNamespace(text_config=SimpleNamespace(model_type=info.target_text_model_type)))
        if reason is not None:
            return None, f"vLLM cannot serve this target: {reason}."
        plugin = (
            f"The dflash_hf plugin registers a hidden-state variant of vLLM 0.34's {arch} class: install\n"
            "dflash_hf in vLLM's environment (the serving environment of dflash_hf's README)"
        )
        if (arch, config.variant) in MEASURED_PLUGIN_PAIRS:
            served = f"{MEASURED_SERVING['plugin']} serves this draft with its target ({_MEASURED_WHERE})."
            return "plugin", f"{served}\n{plugin}."
        return None, f"{plugin}; serving this pair has not been measured yet, so no command is given here."
    return None, f"No serving engine has been measured with {arch} targets: decode with dflash_hf."


def serving_commands(
    config: DFlashConfig, draft: str, target: str, revision: str | None = None, info: DraftCardInfo | None = None
) -> dict[str, str]:
    """The engine commands that serve `target` with the draft `draft` (a Hub id or a local directory), by engine
    (`"vllm"`), for target kinds with a measured row only (`serving_status`); none for a draft outside the published
    contract (no engine serves it) or an unmeasured pair."""
    info = info or DraftCardInfo(target_id=target, target_revision=revision)
    if serving_status(config, info)[0] is None:
        return {}
    return {"vllm": _vllm_command(config, draft, target, revision)}


def _vllm_command(config: DFlashConfig, draft: str, target: str, revision: str | None) -> str:
    """`vllm serve` of `target` with the draft `draft` as its speculative model."""
    revision_flag = f" --revision {revision}" if revision else ""
    spec = json.dumps({"method": "dflash", "model": draft, "num_speculative_tokens": config.block_size - 1})
    return f"vllm serve {target}{revision_flag} \\\n  --speculative-config '{spec}'"


def build_model_card(config: DFlashConfig, repo_id: str, info: DraftCardInfo) -> str:
    """README.md of a published draft: metadata, draft facts, data, validation tau, how to serve it."""
    variant = ARCHITECTURES[config.variant]
    target = f"`{info.target_id}`" + (f" (revision `{info.target_revision}`)" if info.target_revision else "")
    revision_arg = f', revision="{info.target_revision}"' if info.target_revision else ""
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
    if config.encoder_context:
        rows.append(
            (
                "encoder context (outside the contract)",
                f"cross-attention to {config.encoder_hidden_size}-wide target encoder frames in every layer",
            )
        )
    header = "\n".join(meta)
    draft_table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    measured_on = f" ({info.eval_name})" if info.eval_name else ""
    spec_tokens = config.block_size - 1
    serving = _CONTRACT_SERVING if config.in_published_contract else _ENCODER_CONTEXT_SERVING
    if config.in_published_contract:
        serving += "\n\n" + serving_status(config, info)[1]
    commands = serving_commands(config, repo_id, info.target_id, info.target_revision, info)
    engines = "".join(f"\n\n{ENGINE_NAMES[engine]}:\n\n```bash\n{command}\n```" for engine, command in commands.items())
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

{serving}{engines}

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


def remote_code_files(export_dir: Path) -> list[Path]:
    """The remote code AutoModel needs to load the export: the model and config files and the sibling files they
    import (an export written before a sibling file existed does not need it)."""
    from transformers.dynamic_module_utils import get_relative_imports

    needed, todo = set(), ["modeling_dflash.py", "configuration_dflash.py"]
    while todo:
        name = todo.pop()
        if name not in needed and (export_dir / name).is_file():
            todo += [f"{m}.py" for m in get_relative_imports(export_dir / name)]
        needed.add(name)
    return [export_dir / name for name in sorted(needed)]


def _stage_upload(export_dir: Path, staging: Path, config: DFlashConfig, repo_id: str, info: DraftCardInfo) -> None:
    """Copy exactly the files serving needs into `staging`, plus the generated README.md."""
    weights = weight_file_paths(export_dir)
    index = [export_dir / WEIGHTS_INDEX_NAME] if (export_dir / WEIGHTS_INDEX_NAME).is_file() else []
    code = remote_code_files(export_dir)
    absent = [p.name for p in code if not p.is_file()]
    if absent or "auto_map" not in json.loads((export_dir / "config.json").read_text()):
        raise FileNotFoundError(
            f"{export_dir} lacks remote code ({absent or 'config.json auto_map'}) that lets AutoModel load the "
            "draft; re-export it with dflash_hf.export.drafts.export_draft (save_pretrained)"
        )
    record = [export_dir / TRAINING_RECORD_FILE] if (export_dir / TRAINING_RECORD_FILE).is_file() else []
    files = [export_dir / "config.json", *code, *record, *index, *weights]
    skipped = sorted({p.name for p in export_dir.iterdir()} - {p.name for p in files} - {"README.md"})
    if skipped:
        logger.warning("push_draft_to_hub: not uploading %s from %s", skipped, export_dir)
    staging.mkdir(parents=True, exist_ok=True)
    for p in files:
        shutil.copy2(p, staging / p.name)
    (staging / "README.md").write_text(build_model_card(config, repo_id, info))


@contextmanager
def _staging_folder(dry_run_dir: str | Path | None) -> Iterator[Path]:
    """Where the upload is staged: `dry_run_dir` (new or empty, kept), else a temporary folder."""
    if dry_run_dir is not None:
        dry_run_dir = Path(dry_run_dir)
        if dry_run_dir.exists() and any(dry_run_dir.iterdir()):
            raise FileExistsError(f"dry_run_dir={str(dry_run_dir)!r} is not empty; give a new or empty folder")
        yield dry_run_dir
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


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
    weights). Uploaded: config.json, the weights, the remote code (`remote_code_files`), the training record, README.md;
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
    api = None if dry_run_dir is not None else HfApi(token=token)
    with _staging_folder(dry_run_dir) as staging:
        _stage_upload(export_dir, staging, config, repo_id, card_info)
        if api is None:
            return str(staging)
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(staging),
            repo_type="model",
            commit_message=commit_message or f"Upload {ARCHITECTURES[config.variant]} for {card_info.target_id}",
        )
    return commit.commit_url


__all__ = [
    "DraftCardInfo",
    "build_model_card",
    "serving_commands",
    "serving_status",
    "target_serving_facts",
    "push_draft_to_hub",
]
