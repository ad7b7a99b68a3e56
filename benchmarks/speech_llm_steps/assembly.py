"""``assemble``: Whisper-base's encoder and a causal LLM as a genuine ``Qwen2AudioForConditionalGeneration``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from quality_steps.common import SAMPLING_RATE, write_json

from .data import load_audio
from .modeling import encode_audio, save_target
from .presets import DEFAULT_LLM, LLM_PRESETS, QWEN2_TEXT_MODEL, LlmPreset, chat_template


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
    """Ids of existing tokens (``{flag: token}``) that text encodes to themselves; refuses unknown tokens, tokens the
    tokenizer splits into pieces and repeated ones."""
    vocab = tokenizer.get_vocab()
    out = {}
    for flag, token in names.items():
        if token not in vocab:
            raise ValueError(
                f"--{flag} {token!r} is not a token of the LLM's tokenizer; pick one of its special "
                f"tokens (e.g. {tokenizer.all_special_tokens[:8]})"
            )
        out[flag] = vocab[token]
        pieces = tokenizer(token, add_special_tokens=False)["input_ids"]
        if pieces != [out[flag]]:
            raise ValueError(
                f"--{flag} {token!r} is token {out[flag]}, but the LLM's tokenizer encodes the text {token!r} as "
                f"{pieces}: it is not an added token there, so the processor's audio markers would never match; "
                "register it as an added token (`speech_llm.py fetch-llm` does for GGUF conversions) or pick another"
            )
    if len(set(out.values())) != len(out):
        raise ValueError(f"--audio_bos_token, --audio_token and --audio_eos_token must differ: {names}")
    return out


def recorded_mask_id(llm_dir: Path, preset: LlmPreset) -> int | None:
    """The DFlash mask token id of the LLM: as ``fetch-llm`` stamped it, else the preset's."""
    stamp = Path(llm_dir) / "converted.json"
    recorded = json.loads(stamp.read_text()).get("mask_token_id") if stamp.is_file() else None
    return preset.mask_token_id if recorded is None else int(recorded)


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
    save_target(model, processor, out)
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
