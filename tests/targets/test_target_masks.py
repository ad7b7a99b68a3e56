"""The frozen target's decoder mask built on the device when the host knows whether a padded batch has padding
(`FrozenTarget.target_inputs(batch, padded=...)`, what the trainer's CPU plan tells), or no mask for a batch without
padding: the taps and final states equal those of transformers' own mask path bit for bit, and the forward reads
nothing back from the device (transformers' mask helpers read the 2D mask once or twice per forward: a device sync
on a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from utils import random_rows, text_batch, tiny_text_target

from dflash_hf.data import build_train_dataloader
from dflash_hf.data.packing import pack_padded_batch
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny

HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default"}


class HostReads(TorchDispatchMode):
    """Counts the operators that read a tensor's values on the host (a stream synchronize on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += str(func) in HOST_READS
        return func(*args, **(kwargs or {}))


def _same_features_without_host_reads(target: FrozenTarget, batch: dict, layers: list[int]):
    with HostReads() as theirs:
        ref = target.capture(batch, layers, keep_final=True)
    padded = not bool(batch["attention_mask"].bool().all())
    with HostReads() as ours:
        got = target.capture(batch, layers, keep_final=True, padded=padded)
    assert torch.equal(got.taps, ref.taps) and torch.equal(got.final_hidden, ref.final_hidden)
    assert theirs.count > 0  # transformers' mask helpers read the 2D mask
    # with padding the prebuilt mask reads nothing; without, no mask and no packed-sequence detection (is_causal)
    assert ours.count == 0
    return padded


@pytest.mark.parametrize("side", ["right", "left", "none"])
def test_text_target_prebuilt_decoder_mask(side):
    model, tok = tiny_text_target()
    rows = random_rows(3, 250, seed=4)
    if side == "none":  # equal lengths: no padding (transformers' path, unchanged)
        rows = [(p[:6], r[:10]) for p, r in rows]
    batch = text_batch(rows, tok.pad_token_id, "right" if side == "none" else side)
    assert _same_features_without_host_reads(FrozenTarget(model), batch, [1, 2]) == (side != "none")


def test_packed_row_of_one_document_goes_without_mask_or_host_read():
    """A packed row holding one document and no padding: transformers reads its positions to find that it needs no
    mask; the host knows (`cu_seqlens`, `max_seqlen`), so the forward goes without a mask and without the read."""
    model, tok = tiny_text_target()
    row = pack_padded_batch(text_batch(random_rows(1, 250, seed=5), tok.pad_token_id))
    target = FrozenTarget(model)
    assert target.unmasked_causal(row, None) and "attention_mask" not in target.target_inputs(row)
    with HostReads() as theirs:  # transformers' own path: the same forward, its packed-sequence detection kept
        _, ref = target.tapped_forward(
            [0, 2],
            keep_final=True,
            head=False,
            input_ids=row["input_ids"],
            position_ids=row["position_ids"],
            use_cache=False,
        )
    with HostReads() as ours:
        got = target.capture(row, [0, 2], keep_final=True)
    assert theirs.count == 1 and ours.count == 0
    assert torch.equal(got.taps, ref.taps) and torch.equal(got.final_hidden, ref.final_hidden)
    two = pack_padded_batch(text_batch(random_rows(2, 250, seed=5), tok.pad_token_id))
    assert not target.unmasked_causal(two, None)  # two documents: the prebuilt packed mask


@pytest.mark.slow  # 12 s on 2 busy cores
def test_whisper_prebuilt_decoder_mask(tmp_path):
    model, processor = tiny.build_whisper_target(hidden_size=32, num_heads=2, seed=2)
    manifest = tiny.synthesize_speech(tmp_path / "speech", 6, seed=0)
    loader = build_train_dataloader(str(manifest), processor, model.config, max_tokens=400, shuffle=False)
    target = FrozenTarget(model)
    seen = {_same_features_without_host_reads(target, batch, [0, 2]) for batch in loader}
    one = next(iter(loader))
    equal = {k: v[:1] if torch.is_tensor(v) else v for k, v in one.items()}  # one row: no padding
    equal["attention_mask"] = torch.ones_like(equal["attention_mask"][:, : int(one["attention_mask"][0].sum())])
    equal = {
        k: v[:, : equal["attention_mask"].shape[1]] if k in ("input_ids", "loss_mask") else v for k, v in equal.items()
    }
    seen.add(_same_features_without_host_reads(target, equal, [0, 2]))
    assert seen == {True, False}


def test_a_sliding_window_decoder_keeps_transformers_mask():
    """A prebuilt 4D mask reaches every layer unchanged and would take a sliding window's band away: such decoders
    (and model types not checked) keep transformers' own mask, with the same taps."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

    for config in (
        MistralConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=4,
        ),
        Qwen3Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=0,
        ),
    ):
        torch.manual_seed(0)
        target = FrozenTarget(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"))
        assert not target.padded_decoder_mask_applies()
        ids = torch.randint(3, 250, (2, 12))
        mask = torch.ones_like(ids)
        mask[1, 8:] = 0
        batch = {"input_ids": ids, "attention_mask": mask}
        ref = target.capture(batch, [0, 1])
        assert torch.equal(target.capture(batch, [0, 1], padded=True).taps, ref.taps)


def test_a_stream_capture_does_not_count_as_tracing_inside_the_unmasked_forward(monkeypatch):
    """transformers (5.17) builds an explicit causal mask whenever a CUDA stream is captured, asked about no tensor;
    inside `without_packed_detection` (a batch known to need no mask) a capture keeps the eager forward's path."""
    from transformers import masking_utils

    from dflash_hf.targets.decoder_masks import without_packed_detection

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    before = masking_utils.is_tracing
    assert before() is True  # transformers' own: a capture counts as tracing
    with without_packed_detection():
        assert masking_utils.is_tracing() is False and masking_utils.find_packed_sequence_indices(None) is None
        assert masking_utils.is_tracing(torch.ones(2)) is True  # asked about a tensor: transformers' answer
    assert masking_utils.is_tracing is before


def test_a_transformers_without_the_packed_detection_helper_keeps_its_own_path(monkeypatch):
    from transformers import masking_utils

    from dflash_hf.targets.decoder_masks import without_packed_detection

    monkeypatch.delattr(masking_utils, "find_packed_sequence_indices")
    tracing = masking_utils.is_tracing
    with without_packed_detection():
        assert not hasattr(masking_utils, "find_packed_sequence_indices") and masking_utils.is_tracing is not tracing
    assert masking_utils.is_tracing is tracing and not hasattr(masking_utils, "find_packed_sequence_indices")
