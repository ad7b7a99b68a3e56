"""Data epochs of a training loader without a length, with a position that checkpoints save and restore.

The Trainer takes a loader without a length as one epoch of `max_steps` steps and, on resume, skips
`global_step` batches of that one epoch: past the first data epoch it trains on other batches than the
uninterrupted run. `DFlashTrainer` therefore hands the Trainer an `EpochStream` (the data epochs back to back,
no length, nothing for the Trainer to skip) and restores the position itself from the checkpoint
(docs/RELIABILITY.md, "Faults and resume"). No lhotse here: HF iterable datasets use it too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_END = object()
EMPTY_BATCH = object()
"""What `_epoch_batches` yields for a batch whose samples were all skipped: counted in the position, not handed out."""


def replay_error(epoch: int, consumed: int) -> ValueError:
    """A restored position beyond the end of its epoch: the data or the batch settings changed since the save."""
    return ValueError(
        f"resume: epoch {epoch} of the training data has fewer than the {consumed} batches the checkpoint had "
        "handed out; resume with the same data and batch settings (or set ignore_data_skip=true to restart the "
        "data stream)"
    )


class ResumableEpochs:
    """Position of a loader in its epochs: the epoch, the batches handed out in it (not those prefetched by
    workers) and the batch counts of the epochs before it. A subclass iterates one epoch from the position
    with `_epoch_batches()` (skipping the batches already handed out) and sets the epoch in `_start_epoch`."""

    def _init_position(self) -> None:
        self.epoch = 0
        self.batches_consumed = 0
        self.epoch_batches: list[int] = []  # batch count of each completed epoch (this rank)
        self._epoch_done = False  # the epoch's last batch has been handed out
        self._restored = False  # load_state_dict ran: the next iteration continues from its position

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.batches_consumed, self._epoch_done = epoch, 0, False

    def _epoch_batches(self) -> Iterator:
        raise NotImplementedError

    def _hand_out(self) -> Iterator:
        """The rest of the current epoch, counting batches as they are handed out. One batch of lookahead: the
        epoch's end is known when its last batch is handed out."""
        self._epoch_done, self._restored = False, False
        self._handed_out, self._from_start = 0, self.batches_consumed == 0  # batches this pass yields; a whole epoch
        batches = self._epoch_batches()
        batch = next(batches, _END)
        while batch is not _END:
            following = next(batches, _END)
            self.batches_consumed += 1
            self._epoch_done = following is _END
            if batch is not EMPTY_BATCH:
                self._handed_out += 1
                yield batch
            batch = following
        self._epoch_done = True

    def one_epoch(self) -> Iterator:
        """The current epoch from its start, or, right after `load_state_dict`, from the restored position."""
        if not self._restored:
            self.batches_consumed = 0
        return self._hand_out()

    def epochs(self) -> Iterator:
        """Endless: the rest of the current epoch, then every next epoch. An epoch without a single batch (or whose
        batches all lost every sample to skips when read) is an error: the data would never yield one."""
        while True:
            yield from self._hand_out()
            if self.batches_consumed == 0 or (self._from_start and self._handed_out == 0):
                raise ValueError(
                    f"epoch {self.epoch} of the training data gave no batch on this rank (all samples skipped, or "
                    "fewer batches than ranks); add data or lower the number of ranks"
                )
            self.epoch_batches.append(self.batches_consumed)
            self._start_epoch(self.epoch + 1)

    @property
    def epoch_progress(self) -> float:
        """Data epochs done, as a float: completed epochs plus the fraction of the current one handed out,
        estimated from the previous epoch's batch count and kept below 1 until the epoch really ends (during
        the first epoch, whose length is unknown, the fraction is 0)."""
        if self._epoch_done and self.batches_consumed:
            return float(self.epoch + 1)
        last = self.epoch_batches[-1] if self.epoch_batches else 0
        fraction = min(self.batches_consumed, last - 1) / last if last > 1 else 0.0
        return round(self.epoch + fraction, 4)

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "batches_consumed": self.batches_consumed,
            "epoch_batches": list(self.epoch_batches),
        }

    def load_state_dict(self, state: dict) -> None:
        """The next iteration continues right after the batches handed out before `state` was taken."""
        self._start_epoch(state["epoch"])
        self.batches_consumed = state["batches_consumed"]
        self.epoch_batches = list(state.get("epoch_batches", []))
        self._restored = True


class ReplayedEpochs(ResumableEpochs):
    """Position for any loader (an HF `IterableDataset`'s DataLoader): epochs set with its `set_epoch` (when it
    has one); batches already handed out in the current epoch are read again and dropped on resume."""

    def __init__(self, loader):
        self.loader = loader
        self._init_position()

    def _epoch_batches(self) -> Iterator:
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(self.epoch)
        batches = iter(self.loader)
        for _ in range(self.batches_consumed):
            if next(batches, _END) is _END:
                raise replay_error(self.epoch, self.batches_consumed)
        return batches


class EpochStream:
    """What the Trainer iterates: the epochs of a `ResumableEpochs` back to back from its current position.
    It has no length, `set_epoch` or sampler, so the Trainer neither counts nor skips batches."""

    def __init__(self, position: ResumableEpochs):
        self.position = position

    def __iter__(self) -> Iterator:
        return self.position.epochs()


@contextmanager
def trainer_skips_nothing(args, streams_epochs: bool) -> Iterator[bool]:
    """A loader without a length (`streams_epochs`) has its position restored by `DFlashTrainer`; the Trainer's
    batch skipping, which counts `max_steps` as one epoch, must not apply to it: `args.ignore_data_skip` is set
    only for the block. Yields the user's own `ignore_data_skip`."""
    user_ignores_data_skip = args.ignore_data_skip
    if streams_epochs:
        args.ignore_data_skip = True
    try:
        yield user_ignores_data_skip
    finally:
        args.ignore_data_skip = user_ignores_data_skip
