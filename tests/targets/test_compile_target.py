"""`torch_compile_layers: [target]` (torch.compile of the frozen target's decoder layers): taps, final states and
`target_argmax` labels equal the eager target's, and one dynamic-shape graph serves every layer, batch shape and tap
choice (the tap hooks stay outside the compiled region). Runs on CPU (inductor needs a C compiler, present in CI)."""

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from dflash_hf.objective.blocks import doc_ids_from
from dflash_hf.objective.labels.target_argmax import target_argmax_labels
from dflash_hf.targets.builder import compile_target_layers
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny


def _padded_batch(rows: int, width: int, seed: int) -> dict:
    """Random ids, every row right-padded by a different amount (so the decoder always gets a padding mask)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (rows, width), generator=g)
    am = torch.ones_like(ids)
    for r in range(rows):
        am[r, width - 1 - 2 * r :] = 0
    loss_mask = am.bool().clone()
    loss_mask[:, :3] = False
    return {"input_ids": ids, "attention_mask": am, "loss_mask": loss_mask}


def _features_and_labels(target: FrozenTarget, batch: dict, layer_ids: list[int]):
    feats = target.capture(batch, layer_ids, keep_final=True)
    doc_ids = doc_ids_from(batch["attention_mask"])
    labels = target_argmax_labels(
        target, feats.final_hidden, batch["input_ids"], batch["loss_mask"], doc_ids, chunk_size=16
    )
    return feats, labels


@pytest.mark.slow  # 9 s on 2 busy cores
def test_compiled_target_layers_give_the_eager_taps_and_labels_without_recompiling():
    model = tiny.build_text_target(num_layers=3)
    eager, compiled = FrozenTarget(model), FrozenTarget(model)
    cases = [(_padded_batch(2, 17, seed=0), [0, 2]), (_padded_batch(3, 29, seed=1), [1, 2])]
    reference = [_features_and_labels(eager, batch, taps) for batch, taps in cases]

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compile_target_layers(compiled)
    compile_target_layers(compiled)  # idempotent: a shared target is compiled once
    assert all(getattr(layer.forward, "_torchdynamo_orig_callable", None) for layer in compiled.layers)
    for (batch, taps), (ref_feats, ref_labels) in zip(cases, reference):
        feats, labels = _features_and_labels(compiled, batch, taps)
        torch.testing.assert_close(feats.taps, ref_feats.taps, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(feats.final_hidden, ref_feats.final_hidden, rtol=1e-5, atol=1e-5)
        assert torch.equal(labels, ref_labels)
        assert not torch.equal(labels, batch["input_ids"])  # labels did come from the target
    # one graph for 3 layers x 2 batch shapes x 2 tap choices: dynamic shapes, hooks outside the compiled code
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1
