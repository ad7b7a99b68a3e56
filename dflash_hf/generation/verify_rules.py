"""What the target's scores decide in a speculative cycle: its logits processors applied to the verified block,
acceptance of the draft's proposal (greedy prefix match, or rejection sampling that keeps the target's distribution)
and where decoding stops. Used by :mod:`dflash_hf.generation.speculative`'s draft/verify loop."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager

import torch
from transformers import (
    EosTokenCriteria,
    LogitsProcessorList,
    MaxLengthCriteria,
    MinPLogitsWarper,
    StoppingCriteriaList,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dflash_hf.targets.frozen import FrozenTarget


class _DropLengthWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "seem to have been set. `max_new_tokens` will take precedence" not in record.getMessage()


@contextmanager
def max_new_tokens_given():
    """Around a `generate(max_new_tokens=...)` call: drop transformers' warning that the model's generation config
    also sets `max_length` (Whisper's 448: once per call, so once per prompt), since `max_new_tokens` is meant."""
    log = logging.getLogger("transformers.generation.utils")
    quiet = _DropLengthWarning()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def eos_token_ids(target: FrozenTarget) -> set[int]:
    return target.special_ids().get("eos_token_id", set())


def pick_tokens(logits: torch.Tensor, temperature: float, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens and (for sampling) their distributions from `[n, V]` logits."""
    if temperature <= 0:
        return logits.argmax(-1), None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs


def propose_block(draft, hidden: torch.Tensor, lm_head: torch.nn.Module, anchor_token: int, temperature, generator):
    """Draft tokens for slots 1..B-1 from the draft hidden `[B, H]` (variants may override with
    `draft.propose_block`, e.g. DFlash2's selector walk)."""
    custom = getattr(draft, "propose_block", None)
    if custom is not None:
        return custom(hidden, lm_head, anchor_token, temperature, generator)
    return pick_tokens(lm_head(hidden[1:]), temperature, generator)


def accept_tokens(draft_tokens, q_probs, target_logits, temperature, generator) -> tuple[int, int]:
    """Number of accepted draft tokens and the next (bonus or corrected) token.

    `target_logits[i]` is the target's prediction after block position i (`[B, V]`)."""
    n = draft_tokens.shape[0]
    if temperature <= 0:
        t = target_logits.argmax(-1)
        agree = (draft_tokens == t[:n]).long()
        k = int(agree.cumprod(0).sum())
        return k, int(t[k])
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    for i in range(n):
        d = draft_tokens[i]
        ratio = p[i, d] / q_probs[i, d].clamp(min=1e-20)
        if torch.rand((), generator=generator, device=p.device) < ratio.clamp(max=1.0):
            continue
        residual = (p[i] - q_probs[i]).clamp(min=0)
        residual = residual / residual.sum() if residual.sum() > 0 else p[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return n, int(torch.multinomial(p[n], 1, generator=generator))


def accept_greedy_prefix(
    draft_tokens: torch.Tensor, target_scores: torch.Tensor
) -> tuple[int, torch.Tensor, list[int]]:
    """Greedy acceptance with one device-to-host copy: the number of accepted draft tokens `k`, the new tokens
    (the target's argmax at block positions `0..k`: the accepted draft tokens equal it, the last is the bonus) on
    the device and the same ids on the host. The target's argmax and the draft tokens are read together and
    compared on the host (two operators on the device: the argmax and the concatenation)."""
    t = target_scores.argmax(-1)
    n = draft_tokens.shape[0]
    host = torch.cat([t, draft_tokens.to(t.dtype)]).tolist()
    target, drafted = host[: n + 1], host[n + 1 :]
    k = next((i for i, (d, tt) in enumerate(zip(drafted, target)) if d != tt), n)
    return k, t[: k + 1], target[: k + 1]


def accept_prefix(draft_tokens, q_probs, target_scores, temperature, generator) -> tuple[int, torch.Tensor, list[int]]:
    """`k`, the new tokens on the device and on the host (accepted draft tokens then the bonus or corrected one)."""
    if temperature <= 0:
        return accept_greedy_prefix(draft_tokens, target_scores)
    k, bonus = accept_tokens(draft_tokens, q_probs, target_scores, temperature, generator)
    new_ids = draft_tokens[:k].tolist() + [bonus]
    return k, torch.tensor(new_ids, device=draft_tokens.device), new_ids


class _CachedSuppression:
    """`SuppressTokensLogitsProcessor` with its vocabulary mask built once (at its first call, for that call's
    vocabulary size and device; again only if they change) instead of at every call: the processor's scores, -inf
    at the suppressed ids and unchanged elsewhere (`masked_fill` of the mask the processor builds). Whenever it
    builds the mask it also runs the processor itself and compares: if a transformers version ever made them
    differ, it hands every later call to the processor (the target's own processors decide, DESIGN section 3)."""

    def __init__(self, processor: SuppressTokensLogitsProcessor):
        self.processor = processor
        self.mask: torch.Tensor | None = None
        self.delegate = False

    def tokens(self) -> torch.Tensor:
        return self.processor.suppress_tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.delegate:
            return self.processor(input_ids, scores)
        if self.mask is None or self.mask.shape[0] != scores.shape[-1] or self.mask.device != scores.device:
            vocab = torch.arange(scores.shape[-1], device=scores.device)
            self.mask = torch.isin(vocab, self.tokens().to(scores.device))
            ours, theirs = scores.masked_fill(self.mask, -float("inf")), self.processor(input_ids, scores)
            self.delegate = not torch.allclose(ours, theirs, rtol=0.0, atol=0.0, equal_nan=True)
            return theirs
        return scores.masked_fill(self.mask, -float("inf"))


class _CachedBeginSuppression(_CachedSuppression):
    """`SuppressTokensAtBeginLogitsProcessor` with its mask built once: applied when the ids are `begin_index`
    long (read from the processor at each call, as `set_begin_index` may change it), the scores unchanged
    otherwise."""

    def tokens(self) -> torch.Tensor:
        return self.processor.begin_suppress_tokens

    @property
    def begin_index(self) -> int:
        return self.processor.begin_index

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] != self.begin_index:
            return scores
        return super().__call__(input_ids, scores)


_CACHED = {
    SuppressTokensLogitsProcessor: _CachedSuppression,
    SuppressTokensAtBeginLogitsProcessor: _CachedBeginSuppression,
}


def with_cached_masks(processors: LogitsProcessorList) -> LogitsProcessorList:
    """`processors` with the suppressing ones (Whisper's) replaced by equivalents that build their vocabulary mask
    once: for one decode (its processors keep their tokens; the mask follows the vocabulary size and device)."""
    return LogitsProcessorList(_CACHED[type(p)](p) if type(p) in _CACHED else p for p in processors)


# Processors whose output row depends on its score row alone (not on the ids before it): applied to a whole block
# at once. Any other processor runs position by position. Matched by exact type, not isinstance:
# `_CachedBeginSuppression` subclasses `_CachedSuppression` but is not row-wise.
ROW_WISE_PROCESSORS = (
    SuppressTokensLogitsProcessor,
    _CachedSuppression,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
)
# Processors that change only the row whose prefix holds `begin_index` ids (Whisper's begin-suppressed tokens): run on
# that row alone, when the block has it.
BEGIN_INDEX_PROCESSORS = (SuppressTokensAtBeginLogitsProcessor, _CachedBeginSuppression)


def processed_scores(
    processors: LogitsProcessorList, prefix: torch.Tensor, logits: torch.Tensor, block: torch.Tensor | None = None
) -> torch.Tensor:
    """Scores `[n, V]` for logits `[n, V]` whose row i follows `ids[:, :L-n+1+i]`, `ids` `[1, L]` being `prefix`
    followed by `block` (the ids after it, `[m]`; none if not given): the target's logits processors in their order,
    each row seeing the ids before it, as `generate` applies them token by token (in float32, as `generate` does).
    `prefix` and `block` are joined only for a processor that is given ids past `prefix` (row-wise processors read
    none)."""
    scores = logits.float()
    extra = 0 if block is None else block.shape[0]
    start = prefix.shape[1] + extra - scores.shape[0] + 1
    joined: list[torch.Tensor] = []

    def ids(length: int) -> torch.Tensor:
        if length <= prefix.shape[1]:
            return prefix[:, :length]
        if not joined:
            joined.append(torch.cat([prefix, block.view(1, -1).to(prefix.dtype)], dim=1))
        return joined[0][:, :length]

    for proc in processors:
        if type(proc) in ROW_WISE_PROCESSORS:
            scores = proc(prefix, scores)  # reads no ids
        elif type(proc) in BEGIN_INDEX_PROCESSORS:
            i = proc.begin_index - start
            if 0 <= i < scores.shape[0]:
                scores = torch.cat([scores[:i], proc(ids(start + i), scores[i : i + 1]), scores[i + 1 :]])
        else:
            scores = torch.cat([proc(ids(start + i), scores[i : i + 1]) for i in range(scores.shape[0])])
    return scores


# first_stop(grown, length, scores, new_ids): the index j of the first new token `grown[0, length + j]` that ends
# decoding (`scores[j]` the scores it was chosen from; `new_ids` the new tokens `grown[0, length:]` on the host), or
# None.
FirstStop = Callable[[torch.Tensor, int, torch.Tensor, list[int]], "int | None"]


def eos_or_length_stop(eos: set[int], max_length: int | None) -> FirstStop:
    """Stop at an end token or at `max_length` tokens (prompt included)."""

    def first_stop(grown, length, scores, new_ids):
        for j, token in enumerate(new_ids):
            if token in eos or (max_length is not None and length + j + 1 >= max_length):
                return j
        return None

    return first_stop


def criteria_stop(criteria: StoppingCriteriaList) -> FirstStop:
    """`generate`'s stopping criteria, checked after each new token as `generate` does (its usual max-length
    and end-token criteria are read once instead of being run per token; others run on every new token's
    prefix, read back in one device-to-host copy)."""
    if all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in criteria):
        lengths = [c.max_length for c in criteria if isinstance(c, MaxLengthCriteria)]
        eos = {int(t) for c in criteria if isinstance(c, EosTokenCriteria) for t in c.eos_token_id.flatten().tolist()}
        return eos_or_length_stop(eos, min(lengths) if lengths else None)

    def first_stop(grown, length, scores, new_ids):
        hits = torch.cat([criteria(grown[:, : length + j + 1], scores[j : j + 1]) for j in range(len(new_ids))])
        return next((j for j, hit in enumerate(hits.tolist()) if hit), None)

    return first_stop
