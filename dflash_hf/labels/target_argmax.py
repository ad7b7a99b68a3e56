"""`--label_source target_argmax` (the default): `label[t] = argmax lm_head(final_norm(h[t-1]))` of the frozen target
at every supervised t whose predecessor is a real token of the same document (`FrozenTarget.argmax_labels`, chunked
by `--target_argmax_chunk_size`, no `[S, vocab]` logits); other positions keep their data token."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Labels, LabelSource


@dataclass
class TargetArgmax(LabelSource):
    target_argmax_chunk_size: int = 128

    name = "target_argmax"
    needs_final_hidden = True

    def __call__(self, target, final_hidden, input_ids, plan) -> Labels:
        ids = target.argmax_labels(final_hidden, input_ids, plan.loss_mask, plan.doc_ids, self.target_argmax_chunk_size)
        return Labels(ids=ids)
