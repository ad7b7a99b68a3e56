"""What one speculative decode keeps besides its loop (`dflash_hf.generation.speculative`): the output record, the
target's side of the decode (:class:`TargetVerifier`: its KV cache, the keywords of every forward, a padded prompt's
mask and positions), decoder positions without a new tensor per cycle, and cache cropping."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_hf.generation.prompt_padding import PromptPadding
from dflash_hf.generation.target_cache import cache_keyword
from dflash_hf.targets.frozen import FrozenTarget


@dataclass
class SpeculativeOutput:
    sequences: torch.LongTensor  # [1, prompt + new]
    acceptance_lengths: list[int] = field(default_factory=list)  # accepted draft tokens + 1 per cycle
    num_target_forwards: int = 0
    draft_step: str = "eager"  # how the draft ran: "cuda graph", "fixed-shape, no graph" or "eager"
    verify_step: str = "eager"  # how the target verified: the same three (`verify_cuda_graph`)

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions (a negative argument means "remove" in every transformers 5.x). An
    encoder-decoder cache crops its self-attention part only: the cross-attention cache stays."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


@dataclass
class TargetVerifier:
    """How the target runs one decoding forward: its ids keyword (`input_ids`, or `decoder_input_ids` for an
    encoder-decoder target), keywords kept for every forward (the encoder output), and its KV cache."""

    target: FrozenTarget
    layer_ids: list[int]
    ids_key: str
    cache: object
    step_kwargs: dict = field(default_factory=dict)
    forwards: int = 0
    draft_step: str = "eager"  # set by `decode_loop`: how the draft's step ran (`SpeculativeOutput.draft_step`)
    verify_step: str = "eager"  # and the target's verify (`SpeculativeOutput.verify_step`)
    padding: PromptPadding | None = None  # a padded prompt's mask and positions, kept for every verify

    def __post_init__(self):
        self.cache_key = cache_keyword(self.target.model)  # `past_key_values`, or `cache` from transformers 5.24

    def __call__(self, **kwargs):
        self.forwards += 1
        out, feats = self.target.tapped_forward(
            self.layer_ids, **{self.cache_key: self.cache}, use_cache=True, **self.step_kwargs, **kwargs
        )
        return out.logits[0], feats.taps

    def step(self, ids: torch.Tensor, start: int):
        """The verify of `ids` at cache rows `start ..` (a padded prompt's mask and positions included)."""
        if self.padding is None:
            return self(**{self.ids_key: ids})
        return self(**{self.ids_key: ids}, **self.padding.verify_kwargs(start, start + ids.shape[1]))


class DecoderPositions:
    """Decoder positions `[1, n]` as slices of one `arange`, made once and grown by doubling (no new tensor per
    cycle)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.all = torch.arange(0, device=device)[None]

    def span(self, start: int, stop: int) -> torch.Tensor:
        if stop > self.all.shape[1]:
            self.all = torch.arange(max(stop, 2 * self.all.shape[1]), device=self.device)[None]
        return self.all[:, start:stop]
