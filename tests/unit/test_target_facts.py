"""`FrozenTarget.keeps_last_logits_only` is a real property: `logits_to_keep=1` goes only to forwards that take it
(a decorator above `@property` once made it a bound method, always true)."""

from dflash_hf import tiny
from dflash_hf.target import FrozenTarget


def test_keeps_last_logits_only_follows_the_forward_signature():
    assert FrozenTarget(tiny.build_text_target(num_layers=2)).keeps_last_logits_only is True
    whisper, _ = tiny.build_whisper_target(num_layers=2)  # WhisperForConditionalGeneration takes no logits_to_keep
    assert FrozenTarget(whisper).keeps_last_logits_only is False
