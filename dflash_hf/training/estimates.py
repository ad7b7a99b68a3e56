"""The real acceptance length of a validation set (docs/EVALUATION.md, "Which estimate to trust").

`RealTau` decodes the first `--real_tau_samples` prompts of a validation set (each row cut before its first supervised
token: the prompt a user sends, audio included) with greedy speculative decoding, `--real_tau_max_new_tokens` tokens
each, and returns the mean acceptance length over all draft/verify cycles. Unlike the teacher-forced estimates it
needs nothing of the set's text but its prompts, so it holds whether the text is the target's own output or not.
`DFlashTrainer.evaluate` reports it as `eval_<set>_tau` (`--eval_real_tau`, the default; first in each evaluation's
metrics), and `RealTauCallback` between evaluations (`--real_tau_steps`).
"""

from __future__ import annotations

import math

from dflash_hf.data.eval_rows import dataset_rows, prompts_from, speech_rows_and_collator
from dflash_hf.generation.decode_options import DecodeOptions
from dflash_hf.generation.evaluation import decode_benchmark
from dflash_hf.training.assembly import is_speech_source


class RealTau:
    """`__call__(dataset, name)`: the real tau of a validation set of `trainer` (NaN when no cycle ran). Each set's
    prompts are collated once, with the collator its rows are batched with, and kept."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._prompts: dict[int, tuple[object, list[dict]]] = {}  # id(dataset) -> (dataset, its prompts)

    def prompts(self, dataset, name: str | None = None) -> list[dict]:
        """The first `real_tau_samples` prompts of `dataset` (`name`: the set's, for the message)."""
        kept = self._prompts.get(id(dataset))
        if kept is None or kept[0] is not dataset:
            prompts = prompts_from(*self._rows_and_collator(dataset), self.trainer.args.real_tau_samples)
            if not prompts:
                raise ValueError(
                    f"validation set {name or 'eval_dataset'!r} has no row with a supervised token, so it has no "
                    "prompt to decode for the real tau; fix the data, or set --eval_real_tau false and "
                    "--real_tau_steps 0"
                )
            kept = self._prompts[id(dataset)] = (dataset, prompts)
        return kept[1]

    def _rows_and_collator(self, dataset):
        """The dataset's rows and the collator the trainer batches them with: its `data_collator`, or for speech
        sources the padded collator of the trainer's target family, conversation and padding side."""
        tr = self.trainer
        if not is_speech_source(dataset):
            return dataset_rows(dataset), tr.data_collator
        from dflash_hf.data.loader import default_padding_side  # lhotse is imported only for speech data

        return speech_rows_and_collator(
            dataset,
            tr.processor,
            tr.target.model.config,
            family=tr.target.family,
            conversation=tr.data_args.conversation(),
            padding_side=tr.data_args.padding_side or default_padding_side(tr.processor),
            skip_bad_samples=tr.data_args.skip_bad_samples,
            resample_audio=tr.data_args.resample_audio,
            max_chars_per_second=tr.data_args.max_chars_per_second,  # a path: the rows its loss loader reads
        )

    def __call__(self, dataset, name: str | None = None) -> float:
        tr = self.trainer
        prompts = self.prompts(dataset, name)
        draft = tr.accelerator.unwrap_model(tr.model)
        was_training = draft.training
        draft.eval()
        try:
            return decode_benchmark(
                # the eager draft forward and growing-cache verify: in training the draft's layers may be compiled or
                # sharded, and captured graphs would keep their buffers for the rest of the run
                draft,
                tr.target,
                prompts,
                tr.args.real_tau_max_new_tokens,
                compare_greedy=False,
                warmup=False,
                options=DecodeOptions(draft_cuda_graph=False, verify_cuda_graph=False),
            ).tau
        finally:
            draft.train(was_training)


def with_real_tau(metrics: dict[str, float], trainer, dataset, prefix: str) -> dict[str, float]:
    """`metrics` of one validation set (`prefix`, e.g. `eval_dev`) with its real tau first (`--eval_real_tau`)."""
    if not trainer.args.eval_real_tau:
        return metrics
    tau = trainer.real_tau(dataset, prefix[len("eval_") :] or None)
    return {f"{prefix}_tau": tau, **metrics} if math.isfinite(tau) else metrics


__all__ = ["RealTau", "with_real_tau"]
