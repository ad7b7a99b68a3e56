"""`label_source=target_argmax` (docs/ARCHITECTURE.md): labels equal a brute-force full-logit reference, for left
and right padding and packed documents, independent of the chunk size, without `[S, vocab]` logits."""

import pytest
import torch
from utils import LargestAllocation, mixed_padding_batch, row_inputs

from dflash_hf import DFlashTrainer, DFlashTrainingArguments
from dflash_hf.objective.blocks import move_leading_padding
from dflash_hf.objective.labels import target_argmax
from dflash_hf.objective.labels.target_argmax import target_argmax_labels
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny

MASK_ID = 262


def _packed_batch(pad_id: int) -> tuple[dict, list[int]]:
    """One row: three documents back to back, then padding. Every token of the 2nd document is
    supervised, including its first (whose previous row token belongs to document 1)."""
    g = torch.Generator().manual_seed(5)
    lengths, ids, pos, lm, docs = [9, 11, 7], [], [], [], []
    for d, n in enumerate(lengths):
        ids += torch.randint(3, 256, (n,), generator=g).tolist()
        pos += list(range(n))
        lm += [True] * n if d == 1 else [False] * 3 + [True] * (n - 3)
        docs += [d] * n
    pad = 5
    ids += [pad_id] * pad
    pos += [0] * pad
    lm += [True] * pad  # supervised padding must never be labelled from a predecessor
    docs += [-1] * pad
    cu = torch.tensor([0, 9, 20, 27], dtype=torch.int32)
    batch = {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.tensor([[1] * (len(ids) - pad) + [0] * pad]),
        "loss_mask": torch.tensor([lm]),
        "position_ids": torch.tensor([pos]),
        "cu_seqlens": cu,
    }
    return batch, docs


def _row_docs(batch: dict) -> list[list[int]]:
    """Brute-force document index per token (-1 padding), by walking each row."""
    out = []
    for r in range(batch["input_ids"].shape[0]):
        docs, d = [], -1
        for t in range(batch["input_ids"].shape[1]):
            if not batch["attention_mask"][r, t]:
                docs.append(-1)
                continue
            if "position_ids" in batch:
                d += int(batch["position_ids"][r, t]) == 0
            else:
                d = 0
            docs.append(d)
        out.append(docs)
    return out


def reference_labels(model, batch: dict) -> torch.Tensor:
    """label[t] = argmax of the target's full logits at t-1, where t is supervised and t-1 is a real token
    of the same document; else the input id. Padded rows run with their own padding and mask; packed
    documents run one at a time."""
    ids, lm, docs = batch["input_ids"], batch["loss_mask"], _row_docs(batch)
    with torch.no_grad():
        if "cu_seqlens" in batch:  # packed: every document on its own
            cu = batch["cu_seqlens"].tolist()
            pred = torch.zeros_like(ids)
            for s, e in zip(cu[:-1], cu[1:]):
                pred[:, s:e] = model(input_ids=ids[:, s:e]).logits.argmax(-1)
        else:
            pred = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits.argmax(-1)
    ref = ids.clone()
    for r in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if lm[r, t] and docs[r][t] >= 0 and docs[r][t - 1] == docs[r][t]:
                ref[r, t] = pred[r, t - 1]
    return ref


@pytest.mark.parametrize("layout", ["left", "right", "packed"])
def test_argmax_labels_match_full_logit_reference(text_target_4x64, layout):
    model, tok = text_target_4x64
    if layout == "packed":
        batch, docs = _packed_batch(tok.pad_token_id)
        assert _row_docs(batch)[0] == docs
    else:
        batch = mixed_padding_batch(tok, layout)
    ft = FrozenTarget(model)
    ref = reference_labels(model, batch)
    final, ids, loss_mask, doc_ids, shifts = row_inputs(ft, batch)
    assert bool(shifts.any()) == (layout == "left")
    ref_rows = move_leading_padding(ref, shifts)
    outs = [target_argmax_labels(ft, final, ids, loss_mask, doc_ids, chunk_size=c) for c in (1, 7, 128)]
    for out in outs:
        assert torch.equal(out, ref_rows)
    # the labels really come from the target (not the data) on most supervised positions
    changed = (ref_rows != ids) & loss_mask
    assert int(changed.sum()) > 0.5 * int(loss_mask.sum())
    if layout == "packed":
        first_of_doc2 = 9
        assert loss_mask[0, first_of_doc2] and outs[0][0, first_of_doc2] == ids[0, first_of_doc2]
        assert torch.equal(outs[0][0, -5:], ids[0, -5:])  # padding keeps its id
    else:
        # row 3 starts with a supervised token: no real predecessor, keeps its id
        assert loss_mask[3, 0] and outs[0][3, 0] == ids[3, 0]


@pytest.mark.parametrize("chunk", [1, 7, 128])
def test_argmax_labels_never_allocate_sequence_logits(text_target_4x64, chunk):
    model, tok = text_target_4x64
    batch = mixed_padding_batch(tok, "left")
    ft = FrozenTarget(model)
    final, ids, loss_mask, doc_ids, _ = row_inputs(ft, batch)
    vocab = ft.vocab_size
    with LargestAllocation() as probe:
        target_argmax_labels(ft, final, ids, loss_mask, doc_ids, chunk_size=chunk)
    n_sup = int(loss_mask[:, 1:].sum())
    assert 0 < probe.largest <= min(chunk, n_sup) * vocab
    assert ids.shape[1] * vocab > 7 * vocab  # one row's logits would already break the bound for chunk 1 and 7
    with LargestAllocation() as control:  # the probe does see a full projection
        ft.lm_head(final)
    assert control.largest == final.shape[0] * final.shape[1] * vocab


def test_capture_does_not_compute_sequence_logits(text_target_4x64):
    """The target forward itself keeps only the last position's logits (`logits_to_keep=1`)."""
    model, tok = text_target_4x64
    batch = mixed_padding_batch(tok, "right")
    ft = FrozenTarget(model)
    shapes = []
    handle = ft.lm_head.register_forward_hook(lambda _m, _a, out: shapes.append(tuple(out.shape)))
    try:
        ft.capture(batch, [1, 2], keep_final=True)
    finally:
        handle.remove()
    assert shapes == [(batch["input_ids"].shape[0], 1, ft.vocab_size)]


def test_chunk_size_zero_is_refused(text_target_4x64, tmp_path):
    model, tok = text_target_4x64
    ft = FrozenTarget(model)
    final, ids, loss_mask, doc_ids, _ = row_inputs(ft, mixed_padding_batch(tok, "right"))
    with pytest.raises(ValueError, match="target_argmax_chunk_size must be > 0"):
        target_argmax_labels(ft, final, ids, loss_mask, doc_ids, chunk_size=0)
    with pytest.raises(ValueError, match="target_argmax_chunk_size must be > 0"):
        DFlashTrainingArguments(output_dir=str(tmp_path), target_argmax_chunk_size=0, report_to="none")
    with pytest.raises(ValueError, match="label_source"):
        DFlashTrainingArguments(output_dir=str(tmp_path), label_source="argmax", report_to="none")


@pytest.mark.parametrize("layout", ["left", "packed"])
def test_trainer_draft_forward_uses_reference_labels(text_target_4x64, tmp_path, layout, monkeypatch):
    """End to end through `DFlashObjective.loss` (target forward, row handling, labels)."""
    model, tok = text_target_4x64
    batch = _packed_batch(tok.pad_token_id)[0] if layout == "packed" else mixed_padding_batch(tok, "left")
    args = DFlashTrainingArguments(
        output_dir=str(tmp_path),
        block_size=4,
        num_draft_layers=1,
        mask_token_id=MASK_ID,
        num_anchors=4,
        attention_backend="sdpa",
        target_argmax_chunk_size=5,
        report_to="none",
        use_cpu=True,
        **({"packing": True, "packing_max_tokens": 32} if layout == "packed" else {}),
    )
    trainer = DFlashTrainer(args=args, target=model)
    seen = []
    original = target_argmax.target_argmax_labels

    def spy(*a, **kw):
        seen.append(original(*a, **kw))
        return seen[-1]

    monkeypatch.setattr(target_argmax, "target_argmax_labels", spy)
    plan = trainer.objective.plan(trainer.target, batch, seed=0)
    out = trainer.objective.loss(trainer.model, trainer.target, batch, plan)
    ref = move_leading_padding(reference_labels(model, batch), plan.shifts)
    assert len(seen) == 1 and torch.equal(seen[0], ref)
    # block labels are the reference labels at a+k
    blocks = out.blocks
    for r, n, k in blocks.valid.nonzero().tolist():
        assert blocks.labels[r, n, k] == ref[r, blocks.anchors[r, n] + k + 1]
    assert tiny.MASK_TOKEN == tok.convert_ids_to_tokens(MASK_ID)
