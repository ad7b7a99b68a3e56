"""Anchor sampling (`dflash_hf.objective.blocks.sample_anchors`): what DESIGN section 4 asks of the draw."""

from __future__ import annotations

import torch


def test_row_anchors_are_a_uniform_draw_without_replacement_sorted():
    """`sample_anchors` per row: min(num_anchors, #valid) distinct valid anchors, ascending, -1 after them, the
    width rounded up to pad_multiple; every valid position equally likely (2000 rows with one pattern)."""
    from dflash_hf.objective.blocks import doc_ids_from, sample_anchors, valid_anchor_mask

    g = torch.Generator().manual_seed(0)
    b, s = 6, 40
    am = (torch.arange(s)[None] < torch.tensor([40, 33, 20, 9, 2, 0])[:, None]).long()
    loss_mask = am.bool() & (torch.rand(b, s, generator=g) < 0.7)
    doc = doc_ids_from(am, None)
    valid = valid_anchor_mask(loss_mask, doc)
    anchors = sample_anchors(loss_mask, doc, 5, generator=g, pad_multiple=8)
    assert anchors.shape == (b, 8)
    for row, a in zip(valid, anchors):
        k = min(5, int(row.sum()))
        chosen = a[:k]
        assert (a[k:] == -1).all() and bool(row[chosen].all()) and (chosen.diff() > 0).all()
    drawn = sample_anchors(loss_mask[:1].expand(2000, -1), doc[:1].expand(2000, -1), 3, generator=g)
    counts = torch.bincount(drawn.flatten(), minlength=s)[valid[0]]  # 6000 draws over the row's valid positions
    expected = 6000 / int(valid[0].sum())
    assert ((counts - expected).abs() < 5 * expected**0.5).all() and counts.sum() == 6000
