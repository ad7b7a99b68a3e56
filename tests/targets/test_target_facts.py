"""FrozenTarget facts and inputs: `keeps_last_logits_only` is a real property (a decorator above `@property` once
made it a bound method, always true), and a packed row's prebuilt sdpa mask gives bit-identical taps to
transformers' own mask without reading the positions on the host."""

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_hf.data.packing import pack_padded_batch
from dflash_hf.targets.families.registry import FAMILIES
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny

TAPS = [0, 1]


class HostReads(TorchDispatchMode):
    """Counts operators that read a tensor value on the host (a device sync on CUDA)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)
        return func(*args, **(kwargs or {}))


def _transformers_mask_taps(target: FrozenTarget, batch: dict) -> torch.Tensor:
    """Taps with the packed row given without any mask: transformers detects the documents itself."""
    kwargs = target.target_inputs(batch)
    kwargs.pop("attention_mask", None)
    return target.tapped_forward(TAPS, head=False, use_cache=False, **kwargs)[1].taps


def _rows(lengths: list[int], vocab_low: int, vocab_high: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    am = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(vocab_low, vocab_high, (n,), generator=g)
        am[r, :n] = 1
    return {"input_ids": ids, "attention_mask": am, "loss_mask": am.bool()}


def test_keeps_last_logits_only_follows_the_forward_signature():
    assert FrozenTarget(tiny.build_text_target(num_layers=2)).keeps_last_logits_only is True
    whisper, _ = tiny.build_whisper_target(num_layers=2)  # WhisperForConditionalGeneration takes no logits_to_keep
    assert FrozenTarget(whisper).keeps_last_logits_only is False


def test_packed_text_row_prebuilt_mask_is_bit_identical_and_reads_nothing():
    target = FrozenTarget(tiny.build_text_target(num_layers=2))
    packed = pack_padded_batch(_rows([9, 14, 6], 3, 250), pad_to_multiple_of=8)  # 29 tokens + 3 of padding
    assert target.target_inputs(packed)["attention_mask"].shape == (1, 1, 32, 32)
    with HostReads() as reads:
        taps = target.capture(packed, TAPS).taps
    assert reads.count == 0
    assert torch.equal(taps, _transformers_mask_taps(target, packed))
    single = pack_padded_batch(_rows([12], 3, 250))  # one document, no padding: transformers uses no mask
    assert "attention_mask" not in target.target_inputs(single)


def test_packed_qwen3_asr_row_prebuilt_mask_is_bit_identical():
    model, processor = tiny.build_qwen3_asr_target(num_layers=2)
    target, cfg = FrozenTarget(model), model.config
    seconds = [0.7, 1.3]
    audio_tokens = [FAMILIES["qwen3_asr"].audio_tokens(cfg, int(s * tiny.SAMPLING_RATE)) for s in seconds]
    padded = _rows([3 + n + 6 for n in audio_tokens], 3, 250, seed=1)
    for r, n in enumerate(audio_tokens):
        padded["input_ids"][r, 3 : 3 + n] = cfg.audio_token_id
    frames = [int(s * tiny.SAMPLING_RATE) // 160 for s in seconds]
    width = math.ceil(max(frames) / 100) * 100
    padded["input_features"] = torch.randn(2, tiny.NUM_MEL_BINS, width, generator=torch.Generator().manual_seed(2))
    padded["input_features_mask"] = (torch.arange(width)[None] < torch.tensor(frames)[:, None]).long()
    packed = pack_padded_batch(padded, pad_to_multiple_of=16)
    assert target.target_inputs(packed)["attention_mask"].dim() == 4
    assert torch.equal(target.capture(packed, TAPS).taps, _transformers_mask_taps(target, packed))
