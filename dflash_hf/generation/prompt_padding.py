"""A padded prompt in a one-prompt speculative decode, handled as the target's `generate` handles it.

A prompt padded by its tokenizer or processor (`padding="max_length"`, a padding collator; left or right) carries an
`attention_mask` with zeros, and `generate` gives its positions as `cumsum(mask) - 1` (0 at the padding), then
continues every later position from the prompt's last position id, with a mask of ones for the new tokens. A decode
that masked only the prompt's own forward would attend to the padding afterwards and shift every later position:
another sequence from the first new token. So the decode keeps both for every forward:

- the target's verify (growing cache or fixed-shape) attends through the prompt's mask followed by ones, at the
  positions `generate` would give (:meth:`PromptPadding.verify_kwargs`, :attr:`PromptPadding.offset`);
- the draft never sees the padding: its context is the target features of the prompt's real positions only, in
  order, at positions counted without the padding (how the draft was trained), :attr:`PromptPadding.skipped` fewer
  than the target's cache positions.

Greedy decoding then equals `generate` on the same padded inputs. Targets whose model expands an audio placeholder
itself (decoder positions beyond the prompt's ids) and encoder-decoder decoder prompts take unpadded prompts only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PromptPadding:
    """The padding of one prompt of `length` decoder positions. `keep` `[length]` bool: its real positions;
    `mask` `[1, length]` its attention mask; `offset`: the position id of a later cache row `i` is `i + offset`;
    `skipped`: padded positions (the draft's positions run that many behind the target's cache rows)."""

    keep: torch.Tensor
    mask: torch.Tensor
    offset: int
    skipped: int

    def __post_init__(self):
        self._mask = self.mask  # the prompt's mask followed by ones, grown by doubling
        self._positions = torch.arange(0, device=self.mask.device)[None]

    def verify_kwargs(self, start: int, stop: int) -> dict:
        """`attention_mask` `[1, stop]` and `position_ids` `[1, stop - start]` of a forward over cache rows
        `start .. stop-1` (every earlier row in the cache)."""
        if stop > self._mask.shape[1]:
            grown = max(stop, 2 * self._mask.shape[1])
            self._mask = torch.cat([self.mask, self.mask.new_ones(1, grown - self.mask.shape[1])], dim=1)
        if stop + self.offset > self._positions.shape[1]:
            size = max(stop + self.offset, 2 * self._positions.shape[1])
            self._positions = torch.arange(size, device=self.mask.device)[None]
        return {
            "attention_mask": self._mask[:, :stop],
            "position_ids": self._positions[:, start + self.offset : stop + self.offset],
        }


def generate_positions(mask: torch.Tensor) -> torch.Tensor:
    """The prompt's position ids as transformers' `generate` makes them from its attention mask: `cumsum - 1`, 0 at
    the padding."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def prompt_padding(
    attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, length: int
) -> PromptPadding | None:
    """The padding of a one-prompt decode of `length` decoder positions, from its `attention_mask` `[1, length]` and
    the `position_ids` `generate` made (None: made from the mask as `generate` makes them). None when nothing is
    padded and the positions are `0 .. length-1` (the decode then passes neither)."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            "speculative decoding takes a 2D attention_mask [1, prompt length]; got shape "
            f"{tuple(attention_mask.shape)}"
        )
    if attention_mask is not None and attention_mask.shape != (1, length):
        raise ValueError(
            f"the attention_mask has shape {tuple(attention_mask.shape)}, but the prompt has {length} positions; "
            "pass the attention_mask the tokenizer or processor returned with these input_ids"
        )
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    plain = position_ids is None or tuple(position_ids.shape) != (1, length)
    if not padded and (plain or torch.equal(position_ids[0].cpu(), torch.arange(length))):
        return None  # other shapes (a multimodal rope's): the model continues them itself, as without padding
    if position_ids is None:
        position_ids = generate_positions(attention_mask)
    elif tuple(position_ids.shape) != (1, length):
        raise ValueError(
            f"speculative decoding of a padded prompt takes position_ids of shape [1, {length}] (one position per "
            f"prompt token); got {tuple(position_ids.shape)}: pass the prompt without padding"
        )
    if attention_mask is None:
        attention_mask = torch.ones(1, length, dtype=torch.long, device=position_ids.device)
    keep = attention_mask[0].bool()
    if not bool(keep.any()):
        raise ValueError("the prompt's attention_mask is all zeros: there is no prompt token to decode from")
    mask = attention_mask.long()
    return PromptPadding(
        keep=keep,
        mask=mask,
        offset=int(position_ids[0, -1]) + 1 - length,
        skipped=int((~keep).sum()),
    )


def refuse_padding(attention_mask: torch.Tensor | None, what: str) -> None:
    """Raise when `attention_mask` (of a decode that takes unpadded prompts only: `what`) has padding."""
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        padded = int((attention_mask == 0).sum())
        raise ValueError(
            f"{what} takes an unpadded prompt, but its attention_mask masks {padded} position(s); pass the prompt "
            "without padding (tokenizer or processor with padding=False, or drop the masked positions)"
        )


def check_one_prompt(ids: torch.Tensor) -> None:
    """Speculative decoding takes a batch of one prompt."""
    if ids.shape[0] != 1:
        raise ValueError(f"speculative decoding takes one prompt at a time; got batch {ids.shape[0]}")
