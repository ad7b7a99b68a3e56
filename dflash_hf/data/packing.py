"""Packed (THD) batches: several conversations back to back in one row (b = 1 per rank).

- :class:`PackingSampler`: groups a lazy stream of validated cuts into packs whose decoder token counts
  (``cut.custom["dflash_num_tokens"]``, set by :class:`~dflash_hf.data.sample_checks.SampleValidator`) sum to at most
  ``max_tokens`` (streaming best fit over a few open packs), sharded by rank.
- :func:`pack_padded_batch`: a padded (BSHD) batch of ``n`` documents -> one packed row. Real tokens of each row
  are concatenated in row order; ``position_ids`` restart at 0 per document; ``cu_seqlens`` / ``max_seqlen``
  describe the documents. Audio kwargs pass through unchanged: the audio encoder runs per audio (not packed) and
  the target scatters its outputs into the row's placeholders in order of appearance, which is the row order.
- :class:`PackingCollator`: the padded collator (render, load audio, run the processor) followed by
  :func:`pack_padded_batch`.

The target then runs on the packed row *without* an attention mask and with ``position_ids``: transformers
detects the packed documents from the position restarts and keeps attention inside each document (see
``FrozenTarget.check_packing``).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Iterable, Iterator

import torch
from lhotse import CutSet
from lhotse.utils import streaming_shuffle

from dflash_hf.data.collator import SKIPPED_KEY
from dflash_hf.data.sample_checks import NUM_TOKENS_KEY
from dflash_hf.settings import LoaderSettings
from dflash_hf.targets.families.base import TargetFamily

logger = logging.getLogger("dflash_hf.data")

PACKED_KEYS = ("input_ids", "attention_mask", "loss_mask", "position_ids", "cu_seqlens", "max_seqlen")


def check_family_packable(family: TargetFamily) -> None:
    """Packing needs decoder positions known before the forward: processor-side audio expansion (or text)."""
    if family.is_encoder_decoder:
        raise ValueError(
            f"packing=True is not supported for the encoder-decoder family {family.name!r}: a packed decoder row "
            "would need one encoder input per document and per-document decoder positions. Set packing=False "
            "(padded batches of its short transcripts waste little)"
        )
    if family.expansion == "model":
        raise ValueError(
            f"packing=True is not supported for family {family.name!r}: it expands audio inside the model, whose "
            "merge re-pads rows and recomputes position ids, so document boundaries cannot be kept. Set "
            "packing=False, or use the processor-side family row (e.g. 'qwen2_audio')"
        )


def pack_padded_batch(
    batch: dict, max_tokens: int | None = None, pad_to_multiple_of: int = 1, pad_token_id: int = 0
) -> dict:
    """Padded batch (``input_ids``/``attention_mask``/``loss_mask`` ``[n, S]``, either padding side, plus audio
    kwargs) -> packed batch: ``input_ids``, ``attention_mask``, ``loss_mask``, ``position_ids`` ``[1, T]``,
    ``cu_seqlens`` ``int32 [n + 1]``, ``max_seqlen`` (int), audio kwargs unchanged.

    ``T`` is the real token count rounded up to ``pad_to_multiple_of``; trailing padding has
    ``attention_mask = 0``, ``loss_mask = False``, ``pad_token_id`` and positions ``0, 1, ...`` (its own segment).
    Raises when the real tokens exceed ``max_tokens`` (never truncates)."""
    missing = [k for k in ("input_ids", "attention_mask", "loss_mask") if k not in batch]
    if missing:
        raise KeyError(f"pack_padded_batch: the padded batch lacks {missing}; got keys {sorted(batch)}")
    if "position_ids" in batch or "cu_seqlens" in batch:
        raise ValueError("pack_padded_batch: the batch is already packed (it has position_ids / cu_seqlens)")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    ids, real = batch["input_ids"], batch["attention_mask"].bool()  # [n, S]
    lengths = real.sum(-1)  # [n]
    if ids.dim() != 2 or real.shape != ids.shape or batch["loss_mask"].shape != ids.shape:
        raise ValueError(
            f"pack_padded_batch: need input_ids, attention_mask, loss_mask of one shape [n, S]; got "
            f"{tuple(ids.shape)}, {tuple(real.shape)}, {tuple(batch['loss_mask'].shape)}"
        )
    if bool((lengths == 0).any()):
        raise ValueError(f"pack_padded_batch: rows {(lengths == 0).nonzero().flatten().tolist()} have no real token")
    first = real.int().argmax(-1)
    if bool((real.flip(-1).int().argmax(-1) != ids.shape[1] - first - lengths).any()):
        raise ValueError("pack_padded_batch: every row's real tokens must be contiguous (padding on one side only)")
    total = int(lengths.sum())
    if max_tokens is not None and total > max_tokens:
        raise ValueError(
            f"the packed row needs {total} tokens (documents of {lengths.tolist()}), more than "
            f"packing_max_tokens={max_tokens}. The sampler's token counts disagree with the collated batch; "
            "raise packing_max_tokens or report the samples"
        )
    width = math.ceil(total / pad_to_multiple_of) * pad_to_multiple_of
    pad = width - total
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    doc_pos = torch.arange(total) - torch.repeat_interleave(cu[:-1].long(), lengths)  # [total]

    def row(x: torch.Tensor, fill) -> torch.Tensor:
        return torch.cat([x[real], torch.full((pad,), fill, dtype=x.dtype)])[None]  # [1, T]

    out = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "loss_mask")}
    out["input_ids"] = row(ids, pad_token_id)
    out["attention_mask"] = row(batch["attention_mask"], 0)
    out["loss_mask"] = row(batch["loss_mask"].bool(), False)
    out["position_ids"] = torch.cat([doc_pos, torch.arange(pad)])[None]
    out["cu_seqlens"] = cu
    out["max_seqlen"] = int(lengths.max())
    return out


class PackingCollator:
    """``__call__(cuts) -> packed batch``: ``padded_collator(cuts)`` (one row per cut, e.g.
    :class:`~dflash_hf.data.collator.PaddedCollator`) then :func:`pack_padded_batch`."""

    def __init__(
        self,
        padded_collator: Callable[[list], dict],
        max_tokens: int | None,
        pad_token_id: int = 0,
        pad_to_multiple_of: int = 1,
    ):
        self.padded_collator, self.max_tokens = padded_collator, max_tokens
        self.pad_token_id, self.pad_to_multiple_of = pad_token_id, pad_to_multiple_of

    def __call__(self, cuts) -> dict:
        batch = self.padded_collator(list(cuts))
        skipped = batch.pop(SKIPPED_KEY, None)
        if "input_ids" not in batch:  # every sample was skipped
            return {SKIPPED_KEY: skipped}
        packed = pack_padded_batch(batch, self.max_tokens, self.pad_to_multiple_of, self.pad_token_id)
        if skipped:
            packed[SKIPPED_KEY] = skipped
        return packed


class PackingSampler:
    """Batch sampler yielding packs (CutSets) of total decoder tokens <= ``max_tokens``.

    Streaming best fit: each cut goes into the open pack it fills most tightly; when none of ``num_open`` open
    packs has room, the fullest is emitted. Cuts are shuffled with a ``buffer_size`` streaming shuffle seeded by
    ``(seed, epoch)``. Every rank walks the same stream and keeps packs ``rank, rank + world_size, ...``; a final
    incomplete round (fewer than ``world_size`` packs) is dropped with a warning, so ranks stay in step.
    A cut longer than ``max_tokens`` is an error (the validator normally reports it first, as error or skip)."""

    def __init__(
        self,
        cuts: Iterable,
        max_tokens: int,
        *,
        shuffle: bool = LoaderSettings.shuffle,
        seed: int = LoaderSettings.seed,
        world_size: int = LoaderSettings.world_size,
        rank: int = LoaderSettings.rank,
        buffer_size: int = LoaderSettings.buffer_size,
        num_open: int = 8,
    ):
        if max_tokens <= 0:
            raise ValueError(f"packing_max_tokens must be > 0, got {max_tokens}")
        if num_open < 1:
            raise ValueError(f"num_open must be >= 1, got {num_open}")
        if not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.cuts, self.max_tokens = cuts, max_tokens
        self.shuffle, self.seed, self.buffer_size, self.num_open = shuffle, seed, buffer_size, num_open
        self.world_size, self.rank = world_size, rank
        self.epoch = 0
        self.dropped_packs = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _packs(self) -> Iterator[list]:
        stream = iter(self.cuts)
        if self.shuffle:
            stream = streaming_shuffle(stream, bufsize=self.buffer_size, rng=random.Random(self.seed + self.epoch))
        open_packs: list[tuple[int, list]] = []  # (tokens, cuts)
        for cut in stream:
            n = int(cut.custom[NUM_TOKENS_KEY])
            if n > self.max_tokens:
                raise ValueError(
                    f"cut {cut.id!r} needs {n} tokens, more than packing_max_tokens={self.max_tokens}; "
                    "raise packing_max_tokens or drop the sample"
                )
            fits = [i for i, (used, _) in enumerate(open_packs) if used + n <= self.max_tokens]
            if fits:
                i = max(fits, key=lambda j: open_packs[j][0])
                used, members = open_packs[i]
                open_packs[i] = (used + n, members + [cut])
                continue
            if len(open_packs) == self.num_open:
                yield open_packs.pop(max(range(len(open_packs)), key=lambda j: open_packs[j][0]))[1]
            open_packs.append((n, [cut]))
        yield from (members for _, members in sorted(open_packs, key=lambda p: -p[0]))

    def __iter__(self) -> Iterator[CutSet]:
        self.dropped_packs = 0
        round_: list[list] = []
        for pack in self._packs():
            round_.append(pack)
            if len(round_) == self.world_size:
                yield CutSet.from_cuts(round_[self.rank])
                round_ = []
        if round_:
            self.dropped_packs = len(round_)
            logger.warning(
                "packing: dropped the last %d packs of epoch %d so that all %d ranks get the same number of batches",
                len(round_),
                self.epoch,
                self.world_size,
            )
