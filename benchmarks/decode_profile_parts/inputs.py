"""The target, draft and prompts of a `decode_profile.py` run: a tiny random setup, or the user's target, draft and
data read as `dflash-eval` reads them."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from dflash_hf import DFlashConfig, DFlashDraftModel
from dflash_hf.data.eval_rows import iter_prompts, speech_rows_and_collator
from dflash_hf.data.text_prompts import first_record, json_records
from dflash_hf.data.text_prompts import text_prompts as eval_text_prompts
from dflash_hf.targets.families.base import get_tokenizer
from dflash_hf.targets.frozen import FrozenTarget, load_target, resolve_dtype
from dflash_hf.testing import tiny

from .arguments import ProfileArguments

TINY_BLOCK = 4
TINY_WHISPER_MASK = 364  # <|0.00|>: a timestamp token, never produced when decoding without timestamps


def _random_draft(ft: FrozenTarget, mask_token_id: int) -> DFlashDraftModel:
    cfg = DFlashConfig.from_target_config(
        ft.text_config, mask_token_id=mask_token_id, num_hidden_layers=1, block_size=TINY_BLOCK
    )
    cfg.vocab_size = ft.vocab_size
    torch.manual_seed(0)
    return DFlashDraftModel(cfg).eval()


def tiny_setup(kind: str, num_prompts: int, workdir: Path):
    """A tiny sharpened random target, a random draft and `num_prompts` prompts of `kind` ("text": random token
    ids; "whisper": synthetic speech through the speech data path)."""
    if kind == "text":
        tok = tiny.build_tokenizer()
        model = tiny.sharpen(tiny.build_text_target(tok, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1))
        ft = FrozenTarget(model)
        draft = _random_draft(ft, tok.convert_tokens_to_ids(tiny.MASK_TOKEN))
        gen = torch.Generator().manual_seed(0)
        prompts = []
        for i in range(num_prompts):
            ids = torch.randint(3, 250, (1, 7 + i), generator=gen)
            prompts.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        return ft, draft, prompts
    model, processor = tiny.build_whisper_target(hidden_size=32, num_heads=2, seed=2)
    ft = FrozenTarget(tiny.sharpen(model, seed=2))
    manifest = tiny.synthesize_speech(workdir / "speech", num_prompts, seed=0)
    prompts = speech_prompts(str(manifest), processor, model.config, num_prompts)
    return ft, _random_draft(ft, TINY_WHISPER_MASK), prompts


def speech_prompts(
    path: str, processor, config, limit: int, family: str | None = None, prompt: str | None = None
) -> list[dict]:
    """Prompts of a NeMo speech manifest as `dflash-eval` renders them (validated cuts, the target's processor)."""
    from dflash_hf.data.conversation import ConversationConfig

    rows, collate = speech_rows_and_collator(
        path, processor, config, family=family, conversation=ConversationConfig(prompt=prompt)
    )
    return list(itertools.islice(iter_prompts(rows, collate), limit))


def text_prompts(path: str, tokenizer, text_field: str, limit: int) -> list[dict]:
    """Prompts of JSON lines (`prompt` / `messages`, read as `dflash-eval` reads them) or of a NeMo manifest's
    `text_field` (one user turn)."""
    record = first_record(path)
    if "prompt" in record or "messages" in record:
        return list(itertools.islice(eval_text_prompts(path, tokenizer), limit))
    prompts = []
    for origin, record in itertools.islice(json_records(path), limit):
        text = record.get(text_field)
        if not isinstance(text, str) or not text:
            raise ValueError(
                f"--data {origin}: no text in field --text_field {text_field!r} (keys {sorted(record)}); "
                "give JSON lines with 'prompt' or 'messages', or name the manifest's text field"
            )
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            enc = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        else:
            enc = tokenizer(text, return_tensors="pt")
        prompts.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return prompts


def real_setup(args: ProfileArguments, device: torch.device):
    from dflash_hf.export.drafts import load_draft_strict
    from dflash_hf.targets.processor import load_processor

    ft = FrozenTarget(load_target(args.target, args.precision).to(device), args.family)
    draft = load_draft_strict(args.draft).to(device=device, dtype=resolve_dtype(args.precision)).eval()
    cfg = draft.config
    ft.validate(mask_token_id=cfg.mask_token_id, target_layer_ids=cfg.target_layer_ids, hidden_size=cfg.hidden_size)
    processor = load_processor(args.target)
    if ft.family.has_audio:
        prompts = speech_prompts(args.data, processor, ft.model.config, args.num_prompts, ft.family.name, args.prompt)
    else:
        prompts = text_prompts(args.data, get_tokenizer(processor), args.text_field, args.num_prompts)
    if not prompts:
        raise ValueError(f"--data {args.data!r} gave no prompt")
    return ft, draft, prompts
