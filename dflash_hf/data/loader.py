"""Token-budget bucketing sampler and the resumable training DataLoader."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path

from lhotse import CutSet
from lhotse.dataset import DynamicBucketingSampler
from lhotse.dataset.sampling.base import TokenConstraint
from lhotse.dataset.sampling.dynamic_bucketing import estimate_duration_buckets
from torch.utils.data import DataLoader, Dataset

from dflash_hf.data.bad_samples import BadSamples
from dflash_hf.data.collator import SKIPPED_KEY
from dflash_hf.data.conversation import ConversationConfig
from dflash_hf.data.epochs import EMPTY_BATCH, ResumableEpochs, replay_error
from dflash_hf.data.packing import PackingCollator, PackingSampler, check_family_packable
from dflash_hf.data.sample_checks import NUM_TOKENS_KEY, validated_cutset
from dflash_hf.data.samples import SamplePipeline
from dflash_hf.data.sources import DataSource, mix_sources
from dflash_hf.settings import LoaderSettings
from dflash_hf.targets.families.base import TargetFamily, get_tokenizer
from dflash_hf.targets.families.registry import resolve_family


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
        seen = 0
        for cuts in self.sampler:
            seen += 1
            if seen > skip:
                yield cuts
        if seen < skip:
            raise replay_error(self.epoch, skip)


class CutDataLoader(DataLoader, ResumableEpochs):
    """DataLoader over lhotse batches with a resumable position. Iterating it gives one epoch; ``state_dict()``
    records the epoch, the batches handed out in it (not those prefetched by workers), the batch counts of the
    epochs before it and the skipped samples; ``load_state_dict()`` makes the next iteration resume right after
    them, skipping batches by their metadata only. Batches and their order depend only on ``(seed, epoch)``, so a
    restored position replays exactly. ``epochs()`` streams the epochs back to back (what ``DFlashTrainer``
    trains on, through :class:`~dflash_hf.data.epochs.EpochStream`). ``bad_samples`` counts skipped samples."""

    def __init__(
        self, batch_sampler: ResumableBatchSampler, collate_fn, bad_samples: BadSamples, num_workers: int = 0, **kwargs
    ):
        super().__init__(
            CutBatchDataset(), batch_sampler=batch_sampler, collate_fn=collate_fn, num_workers=num_workers, **kwargs
        )
        self.bad_samples = bad_samples
        self._init_position()

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._start_epoch(epoch)

    def _start_epoch(self, epoch: int) -> None:
        super()._start_epoch(epoch)
        self.batch_sampler.set_epoch(epoch)

    def _epoch_batches(self):
        """The epoch's batches from the position; samples a collator skipped (``SKIPPED_KEY``) are counted in
        ``bad_samples``, and a batch left without samples is ``EMPTY_BATCH`` (counted in the position only)."""
        self.batch_sampler.skip = self.batches_consumed
        for batch in DataLoader.__iter__(self):
            skipped = batch.pop(SKIPPED_KEY, None) if isinstance(batch, dict) else None
            if skipped:
                self.bad_samples.add_skipped(skipped)
            yield batch if not isinstance(batch, dict) or batch else EMPTY_BATCH

    def __iter__(self):
        return self.one_epoch()

    def state_dict(self) -> dict:
        return super().state_dict() | {"skipped": dict(self.bad_samples.skipped)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.bad_samples.skipped.update(state.get("skipped", {}))


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
    settings: LoaderSettings | None = None,
    *,
    family: TargetFamily | str | None = None,
    conversation: ConversationConfig | None = None,
    **options,
) -> CutDataLoader:
    """The training DataLoader (see :mod:`dflash_hf.data` for the contract), built from one `LoaderSettings` (the
    token budget, this rank's place, the sampler, what the batches carry; defaults and checks in
    `dflash_hf.settings.data`); `options` change fields of it by name (`max_tokens=600`, ...). ``packing``: packed
    (THD) batches of one row holding documents whose token counts sum to at most ``max_tokens``
    (:mod:`dflash_hf.data.packing`). ``max_chars_per_second``: a sample whose text has more characters per second of
    audio is bad (None or 0: off; a ``DataSource``'s own applies to its rows when they are read, this one to every
    sample when it is validated)."""
    settings = replace(settings or LoaderSettings(), **options)
    if isinstance(family, str) or family is None:
        family = resolve_family(target_config, family)
    padding_side = settings.padding_side or default_padding_side(processor)
    bad = BadSamples(skip=settings.skip_bad_samples)
    if isinstance(sources, CutSet):
        cuts = sources
    else:
        if isinstance(sources, (DataSource, str, Path)):
            sources = [sources]
        # a path takes this call's rate limit; a DataSource carries its own
        sources = [
            s if isinstance(s, DataSource) else DataSource(str(s), max_chars_per_second=settings.max_chars_per_second)
            for s in sources
        ]
        cuts = mix_sources(sources, seed=settings.seed, bad=bad)
    samples = SamplePipeline.build(
        processor,
        target_config,
        family,
        conversation,
        bad=bad,
        max_tokens=settings.max_tokens,
        resample_audio=settings.resample_audio,
        duration_tolerance=settings.duration_tolerance,
        mask_token_id=settings.mask_token_id,
        max_chars_per_second=settings.max_chars_per_second,
    )
    cuts = validated_cutset(cuts, samples.validator)
    collator = samples.collator(
        padding_side, compact_features=settings.compact_features, device_features=settings.device_features, bad=bad
    )
    place = dict(shuffle=settings.shuffle, seed=settings.seed, world_size=settings.world_size, rank=settings.rank)
    if settings.packing:
        check_family_packable(family)
        sampler = PackingSampler(cuts, settings.max_tokens, buffer_size=settings.buffer_size, **place)
        collator = PackingCollator(
            collator, settings.max_tokens, pad_token_id=get_tokenizer(processor).pad_token_id or 0
        )
    else:
        constraint = TokenBudgetConstraint(max_tokens=settings.max_tokens, max_examples=settings.max_batch_size)
        sampler = DynamicBucketingSampler(
            cuts,
            constraint=constraint,
            drop_last=settings.drop_last,
            buffer_size=settings.buffer_size,
            duration_bins=_bucket_bins(cuts, constraint, settings.num_buckets, settings.num_cuts_for_bins_estimate),
            **place,
        )
    return CutDataLoader(
        ResumableBatchSampler(sampler), collator, bad, num_workers=settings.num_workers, pin_memory=settings.pin_memory
    )
