"""Random batches of a shape: text rows, Whisper utterances, Qwen3-ASR micro-batches (padded or packed)."""

from __future__ import annotations

import math

import torch

from dflash_hf.data.packing import pack_padded_batch
from dflash_hf.targets.families.base import SAMPLING_RATE
from dflash_hf.targets.families.registry import FAMILIES
from dflash_hf.targets.families.whisper_features import AUDIO_WAVES_KEY, padded_waves, standard_extractor
from dflash_hf.targets.frozen import FrozenTarget


def _text_id_limit(target: FrozenTarget, mask_token_id: int) -> int:
    """Random text ids are drawn below this: no special id (pad, eos, audio placeholder) and no mask id."""
    cfg = target.model.config
    specials = [i for ids in target.special_ids().values() for i in ids]
    specials += [
        v for v in (getattr(cfg, "audio_token_id", None), getattr(cfg, "decoder_start_token_id", None)) if v is not None
    ]
    return min([mask_token_id, *(i for i in specials if i >= 3)])  # ids below 3 are never drawn


def make_batch(shape: dict, seq_len: int, batch: int, mask_token_id: int, seed: int, low: int = 2) -> dict:
    """Random ids in `[low, mask_token_id)`; the first eighth of each row is the unsupervised prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, mask_token_id, (batch, seq_len), generator=g)
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    loss_mask[:, seq_len // 8 :] = True
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


def _padded_rows(rows: list[tuple[list[int], list[bool]]], pad_id: int) -> dict:
    """Right-padded `input_ids` / `attention_mask` / `loss_mask` of (ids, supervised) rows."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    am = torch.zeros_like(ids)
    lm = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, (row_ids, sup) in enumerate(rows):
        ids[r, : len(row_ids)] = torch.tensor(row_ids)
        am[r, : len(row_ids)] = 1
        lm[r, : len(row_ids)] = torch.tensor(sup)
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm}


def whisper_batch(shape: dict, target: FrozenTarget, n: int, mask_token_id: int, g: torch.Generator):
    """`n` utterances of `durations` seconds: padded waves as the trainer's loader gives them (random samples up to
    the longest utterance's frames; the step computes their log-mel and the 30 s window on the device),
    decoder rows of `tokens` tokens (longer for longer audio): the 4-token prompt (start of transcript and 3 prompt
    ids, unsupervised), the transcript and the end token (supervised)."""
    cfg = target.model.config
    (lo_s, hi_s), (lo_t, hi_t) = shape["durations"], shape["tokens"]
    durations = (lo_s + (hi_s - lo_s) * torch.rand(n, generator=g)).tolist()
    limit = _text_id_limit(target, mask_token_id)
    rows = []
    for d in durations:
        length = round(lo_t + (d - lo_s) / (hi_s - lo_s) * (hi_t - lo_t))
        text = torch.randint(3, limit, (length - 2,), generator=g).tolist()
        ids = [cfg.decoder_start_token_id, *text, cfg.eos_token_id]
        rows.append((ids, [False] * 4 + [True] * (length - 4)))
    batch = _padded_rows(rows, cfg.pad_token_id)
    extractor = standard_extractor(cfg.num_mel_bins, 2 * cfg.max_source_positions)
    audios = [(0.1 * torch.randn(round(d * SAMPLING_RATE), generator=g)).numpy() for d in durations]
    batch[AUDIO_WAVES_KEY] = torch.from_numpy(padded_waves(extractor, audios, SAMPLING_RATE))
    return batch, sum(durations)  # (batch, audio seconds)


def qwen3_asr_batches(shape: dict, target: FrozenTarget, mask_token_id: int, g: torch.Generator):
    """`num_batches` micro-batches of utterances of `durations` seconds, each filled up to `max_tokens` decoder
    positions. A row is an 8-token prompt, one `audio_token_id` per encoder frame (the processor's expansion),
    4 tokens, then the transcript (`tokens_per_second`) and the end token (supervised). Padded: batch k takes
    durations of the k-th of `num_batches` equal duration buckets, rows until the padded batch would exceed
    `max_tokens`; packed: durations of the whole range back to back in one row (`pack_padded_batch`, what the
    packing collator runs). Features: random mel values, the mask covering each utterance's frames, padded to
    whole 100-frame chunks. Returns `[(batch, audio seconds)]`."""
    cfg = target.model.config
    family = FAMILIES["qwen3_asr"]
    lo, hi = shape["durations"]
    k = shape["num_batches"]
    limit = _text_id_limit(target, mask_token_id)
    chunk = 2 * cfg.audio_config.n_window
    out = []
    for b in range(k):
        span = (lo + (hi - lo) * b / k, lo + (hi - lo) * (b + 1) / k) if not shape["packed"] else (lo, hi)
        rows, durations = [], []
        while True:
            d = span[0] + (span[1] - span[0]) * float(torch.rand((), generator=g))
            samples = int(d * family.sampling_rate)
            n_text = round(shape["tokens_per_second"] * d)
            ids = (
                torch.randint(3, limit, (8,), generator=g).tolist()
                + [cfg.audio_token_id] * family.audio_tokens(cfg, samples)
                + torch.randint(3, limit, (4 + n_text,), generator=g).tolist()
                + [cfg.eos_token_id]
            )
            sup = [False] * (len(ids) - n_text - 1) + [True] * (n_text + 1)
            width = max([len(ids), *(len(r[0]) for r in rows)])
            used = sum(len(r[0]) for r in rows) + len(ids) if shape["packed"] else width * (len(rows) + 1)
            if rows and used > shape["max_tokens"]:
                break
            rows.append((ids, sup))
            durations.append(samples)
        batch = _padded_rows(rows, cfg.pad_token_id)
        frames = [max(n, 8000) // 160 for n in durations]  # the feature extractor's frames (clips < 0.5 s padded)
        width = math.ceil(max(frames) / chunk) * chunk
        batch["input_features"] = torch.randn(len(rows), cfg.audio_config.num_mel_bins, width, generator=g)
        batch["input_features_mask"] = (torch.arange(width)[None] < torch.tensor(frames)[:, None]).long()
        if shape["packed"]:
            batch = pack_padded_batch(batch, shape["max_tokens"], pad_token_id=cfg.pad_token_id)
        out.append((batch, sum(durations) / family.sampling_rate))
    return out


def make_batches(shape: dict, target: FrozenTarget, seq_len: int, batch_size: int, mask_token_id: int, seed: int):
    """The micro-batches one timed cycle runs, each with the audio seconds it holds (0 for text)."""
    kind = shape.get("kind", "qwen3")
    g = torch.Generator().manual_seed(seed)
    if kind == "whisper":
        return [whisper_batch(shape, target, batch_size, mask_token_id, g)]
    if kind == "qwen3_asr":
        return qwen3_asr_batches(shape, target, mask_token_id, g)
    low = 2 if kind == "qwen3" else 3  # qwen3 rows: pad 0, eos 1
    return [(make_batch(shape, seq_len, batch_size, _text_id_limit(target, mask_token_id), seed, low), 0.0)]
