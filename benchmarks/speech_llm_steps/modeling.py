"""The speech LLM's forward on cached audio features, its loss, LoRA on the LLM, and its save."""

from __future__ import annotations

from pathlib import Path

import torch

from .presets import LLM_LINEARS


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


def save_target(model, processor, out: Path) -> None:
    """`save_pretrained` the speech LLM and its processor into `out`, with the weight names vLLM's Qwen2-Audio reads
    whatever transformers wrote (`dflash_hf.serving.checkpoint_layout.rewrite_for_vllm`)."""
    from dflash_hf.serving.checkpoint_layout import rewrite_for_vllm

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    renamed = rewrite_for_vllm(out)
    if renamed:
        print(f"{out}: {renamed} weight names rewritten to the layout vLLM reads")
    processor.save_pretrained(out)
