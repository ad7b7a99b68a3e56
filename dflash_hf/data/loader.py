"""Token-budget bucketing sampler and the resumable training DataLoader."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from lhotse import CutSet
from lhotse.dataset import DynamicBucketingSampler
from lhotse.dataset.sampling.base import TokenConstraint
from lhotse.dataset.sampling.dynamic_bucketing import estimate_duration_buckets
from torch.utils.data import DataLoader, Dataset

from dflash_hf.data.bad_samples import BadSamples
from dflash_hf.data.collator import PaddedCollator
from dflash_hf.data.conversation import ConversationConfig, ConversationRenderer
from dflash_hf.data.packing import PackingCollator, PackingSampler, check_family_packable
from dflash_hf.data.sources import DataSource, mix_sources
from dflash_hf.data.validation import NUM_TOKENS_KEY, SampleValidator, validated_cutset
from dflash_hf.families import TargetFamily, get_tokenizer, resolve_family


@dataclass
class TokenBudgetConstraint(TokenConstraint):
    """Padded-batch token budget: ``batch_size * longest sample`` (audio positions + text tokens) stays within
    ``max_tokens``; ``max_examples`` optionally caps the batch size."""

    def measure_length(self, example) -> float:
        return example.custom[NUM_TOKENS_KEY]


class CutBatchDataset(Dataset):
    """Identity dataset: the batch sampler yields CutSets, the collator does the work."""

    def __getitem__(self, cut):
        return cut

    def __getitems__(self, cuts):
        return list(cuts)


class ResumableBatchSampler:
    """Wraps a lhotse sampler; skips the first ``skip`` batches of the next iteration (metadata only)."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __iter__(self):
        skip, self.skip = self.skip, 0
        for index, cuts in enumerate(self.sampler):
            if index >= skip:
                yield cuts


_END = object()


class CutDataLoader(DataLoader):
    """DataLoader over lhotse batches with a resumable position. Iterating it gives one epoch; ``state_dict()``
    records the epoch, the batches handed out in it (not those prefetched by workers), the batch counts of the
    epochs before it and the skipped samples; ``load_state_dict()`` makes the next iteration resume right after
    them. Batches and their order depend only on ``(seed, epoch)``, so a restored position replays exactly.
    ``epochs()`` streams the epochs back to back (what the Trainer trains on). ``bad_samples`` counts skips."""

    def __init__(self, batch_sampler: ResumableBatchSampler, collate_fn, bad_samples: BadSamples,
                 num_workers: int = 0, **kwargs):
        super().__init__(CutBatchDataset(), batch_sampler=batch_sampler, collate_fn=collate_fn,
                         num_workers=num_workers, **kwargs)
        self.bad_samples = bad_samples
        self._consumed = 0
        self._epoch_done = False  # the epoch's last batch has been handed out
        self.epoch_batches: list[int] = []  # batch count of each completed epoch (this rank)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.batch_sampler.epoch:
            self.batch_sampler.set_epoch(epoch)
            self.batch_sampler.skip = 0
            self._consumed = 0
            self._epoch_done = False

    def __iter__(self):
        # one batch of lookahead: the epoch's end is known when its last batch is handed out
        self._consumed = self.batch_sampler.skip
        self._epoch_done = False
        batches = super().__iter__()
        batch = next(batches, _END)
        while batch is not _END:
            following = next(batches, _END)
            self._consumed += 1
            self._epoch_done = following is _END
            yield batch
            batch = following
        self._epoch_done = True

    def epochs(self) -> Iterator[dict]:
        """Endless stream: the rest of the current epoch, then every next epoch (``set_epoch(epoch + 1)`` at
        each end). An epoch without a single batch is an error (the data would never yield one)."""
        while True:
            yield from self
            if self._consumed == 0:
                raise ValueError(
                    f"epoch {self.batch_sampler.epoch} of the training data gave no batch on this rank (all samples "
                    "skipped, or fewer batches than ranks); add data or lower the number of ranks"
                )
            self.epoch_batches.append(self._consumed)
            self.set_epoch(self.batch_sampler.epoch + 1)

    @property
    def epoch_progress(self) -> float:
        """Data epochs done, as a float: completed epochs plus the fraction of the current one handed out,
        estimated from the previous epoch's batch count and kept below 1 until the epoch really ends (during
        the first epoch, whose length is unknown, the fraction is 0)."""
        epoch = self.batch_sampler.epoch
        if self._epoch_done and self._consumed:
            return float(epoch + 1)
        last = self.epoch_batches[-1] if self.epoch_batches else 0
        return round(epoch + (min(self._consumed, last - 1) / last if last > 1 else 0.0), 4)

    def state_dict(self) -> dict:
        return {"epoch": self.batch_sampler.epoch, "batches_consumed": self._consumed,
                "epoch_batches": list(self.epoch_batches), "skipped": dict(self.bad_samples.skipped)}

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.set_epoch(state["epoch"])
        self.batch_sampler.skip = state["batches_consumed"]
        self._consumed = state["batches_consumed"]
        self._epoch_done = False
        self.epoch_batches = list(state.get("epoch_batches", []))
        self.bad_samples.skipped.update(state.get("skipped", {}))


class EpochStream:
    """What the Trainer iterates for a :class:`CutDataLoader`: its epochs back to back from the loader's
    current position. It has no length, ``set_epoch`` or sampler, so the Trainer neither counts nor skips
    batches: the loader keeps and restores the data position itself."""

    def __init__(self, loader: CutDataLoader):
        self.loader = loader

    def __iter__(self) -> Iterator[dict]:
        return self.loader.epochs()


def default_padding_side(processor) -> str:
    """The processor's own padding side (its ``text_kwargs`` default, else the tokenizer's)."""
    side = (getattr(processor, "text_kwargs", None) or {}).get("padding_side")
    return side or get_tokenizer(processor).padding_side


def _bucket_bins(cuts, constraint, num_buckets: int, num_cuts: int) -> list[float]:
    """Bucket boundaries (in tokens) from the first ``num_cuts`` cuts; validates them before training starts.
    Fewer cuts than buckets (small data) gives fewer buckets."""
    estimate = list(islice(cuts, num_cuts))
    if not estimate:
        raise ValueError("no usable samples in the data sources (all were skipped or the sources are empty)")
    k = min(num_buckets, len(estimate))
    if k < 2:
        return [constraint.measure_length(estimate[0]) + 1]
    return estimate_duration_buckets(estimate, num_buckets=k, constraint=constraint)


def build_train_dataloader(
    sources: Sequence[DataSource | str | Path] | DataSource | str | Path | CutSet,
    processor,
    target_config,
    *,
    max_tokens: int,
    family: TargetFamily | str | None = None,
    max_batch_size: int | None = None,
    conversation: ConversationConfig | None = None,
    padding_side: str | None = None,
    shuffle: bool = True,
    seed: int = 0,
    world_size: int = 1,
    rank: int = 0,
    num_buckets: int = 10,
    drop_last: bool = False,
    num_workers: int = 0,
    skip_bad_samples: bool = False,
    resample_audio: bool = True,
    duration_tolerance: float = 0.05,
    buffer_size: int = 10000,
    num_cuts_for_bins_estimate: int = 10000,
    packing: bool = False,
) -> CutDataLoader:
    """The training DataLoader (see :mod:`dflash_hf.data` for the contract). ``packing=True``: packed (THD)
    batches of one row holding documents whose token counts sum to at most ``max_tokens``
    (:mod:`dflash_hf.data.packing`; ``num_buckets``, ``drop_last`` and ``num_cuts_for_bins_estimate`` unused)."""
    if packing and max_batch_size is not None:
        raise ValueError("max_batch_size does not apply to packing=True (a packed row is bounded by max_tokens only); "
                         "leave it unset")
    if isinstance(family, str) or family is None:
        family = resolve_family(target_config, family)
    if not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    padding_side = padding_side or default_padding_side(processor)
    bad = BadSamples(skip=skip_bad_samples)
    if isinstance(sources, CutSet):
        cuts = sources
    else:
        if isinstance(sources, (DataSource, str, Path)):
            sources = [sources]
        cuts = mix_sources(sources, seed=seed, bad=bad)
    renderer = ConversationRenderer(processor, family, conversation)
    validator = SampleValidator(renderer, family, target_config, max_tokens=max_tokens, bad=bad,
                                resample_audio=resample_audio, duration_tolerance=duration_tolerance)
    cuts = validated_cutset(cuts, validator)
    collator = PaddedCollator(processor, target_config, family, renderer, padding_side)
    if packing:
        check_family_packable(family)
        sampler = PackingSampler(cuts, max_tokens, shuffle=shuffle, seed=seed, world_size=world_size, rank=rank,
                                 buffer_size=buffer_size)
        collator = PackingCollator(collator, max_tokens, pad_token_id=get_tokenizer(processor).pad_token_id or 0)
        return CutDataLoader(ResumableBatchSampler(sampler), collator, bad, num_workers=num_workers)
    constraint = TokenBudgetConstraint(max_tokens=max_tokens, max_examples=max_batch_size)
    sampler = DynamicBucketingSampler(
        cuts, constraint=constraint, shuffle=shuffle, drop_last=drop_last, seed=seed,
        world_size=world_size, rank=rank, buffer_size=buffer_size,
        duration_bins=_bucket_bins(cuts, constraint, num_buckets, num_cuts_for_bins_estimate),
    )
    return CutDataLoader(ResumableBatchSampler(sampler), collator, bad, num_workers=num_workers)
