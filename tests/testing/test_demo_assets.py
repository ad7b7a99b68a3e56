"""The demo's teaching batches: the loader's first epoch as read, then its batches replayed in new orders."""

import itertools

import pytest

from dflash_hf.testing.demo_assets import replayed_epochs


def test_replayed_epochs_reads_the_loader_once_then_reorders_its_batches():
    reads = []

    def loader():
        for i in range(4):
            reads.append(i)
            yield {"i": i}

    batches = [b["i"] for b in itertools.islice(replayed_epochs(loader()), 12)]
    assert batches[:4] == [0, 1, 2, 3] and reads == [0, 1, 2, 3]  # the first epoch in the loader's order, read once
    later = [batches[4:8], batches[8:12]]
    assert all(sorted(epoch) == [0, 1, 2, 3] for epoch in later) and later != [[0, 1, 2, 3]] * 2


def test_replayed_epochs_of_an_empty_loader_raises():
    with pytest.raises(ValueError, match="gave no batch to teach the target with"):
        next(replayed_epochs(iter([])))
