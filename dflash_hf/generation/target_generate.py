"""The target's own generate (greedy, the target alone): the baseline speculative decoding must equal
(`decode_benchmark`) and the generated labels (`dflash-generate-labels`).

- :func:`generate_inputs`: a prompt's processor outputs as the target's `generate` takes them.
- :func:`target_generate`: the target's own greedy `generate` (a model-side single-placeholder target's own loop,
  Whisper's plain `generate` where it gives the same tokens), prompt + new tokens.
- :func:`target_generate_new_tokens`: only the new tokens; :func:`generated_labels`: those of batches of encoded
  prompts, the rows `dflash-generate-labels` writes.
- :func:`target_transcripts`: the decoded text of the target's greedy answer to each prompt (a target's WER).
"""

from __future__ import annotations

import torch

from dflash_hf.generation.model_side import model_side_greedy
from dflash_hf.generation.verify_rules import max_new_tokens_given
from dflash_hf.targets.families.base import get_tokenizer
from dflash_hf.targets.families.registry import generate_kwargs
from dflash_hf.targets.frozen import FrozenTarget


def generate_inputs(ft: FrozenTarget, inputs: dict) -> dict:
    """A prompt's processor outputs on the target's device, float features in its dtype, as `generate` takes them."""
    on_device = {k: v.to(ft.device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    return generate_kwargs(ft.family, ft.cast_features(on_device))


def target_generate(ft: FrozenTarget, inputs: dict, max_new_tokens: int, **generate_options) -> torch.Tensor:
    """The target's own greedy decoding: prompt + new tokens, as `generate(return_dict_in_generate=True)` gives them
    (rows padded with the end token). A model-side single-placeholder target decodes without `generate`, which cannot
    run its audio merge. Whisper with its decoder prompt given takes its plain `generate` (`_whisper_generate`).
    `generate_options` go to `generate` (e.g. `cache_implementation="static"`: a static cache, compiled on a GPU)."""
    if ft.family.expansion == "model":
        if generate_options:
            raise ValueError(
                f"generate options {sorted(generate_options)}: a model-side single-placeholder target "
                "decodes without generate"
            )
        return model_side_greedy(ft, max_new_tokens, **inputs)
    with max_new_tokens_given():
        if ft.family.name == "whisper" and "decoder_input_ids" in inputs:
            new = _whisper_generate(ft, inputs, max_new_tokens, generate_options)
            if new is not None:
                return new
        out = ft.model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True, **generate_options
        )
    return out.sequences


def _whisper_generate(ft: FrozenTarget, inputs: dict, max_new_tokens: int, options: dict) -> torch.Tensor | None:
    """Whisper's plain `generate` returns only the new tokens, its final end token dropped and rows padded with the
    pad token; with `return_dict_in_generate` it would copy every row's self- and cross-attention cache to the CPU and
    back (37 MB a row for Whisper-base), a cost neither a user's `generate` nor speculative decoding pays. The prompt
    and the end token are put back (unless the longest row ran to `max_new_tokens`: then no row of that length ended).
    None (take the dict call) where the two could differ: a pad token other than the one end token (the plain call
    strips every pad id of a row), or a timestamp token in the output (Whisper then splits segments and may decode
    past the window, where the dict call returns the last call's sequences)."""
    gc = ft.model.generation_config
    if not isinstance(gc.eos_token_id, int) or gc.pad_token_id != gc.eos_token_id:
        return None
    prompt = inputs["decoder_input_ids"]
    new = ft.model.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=False, **options
    )  # [b, n]
    timestamps = getattr(gc, "no_timestamps_token_id", None)
    if new.shape[1] > max_new_tokens or (timestamps is not None and bool((new > timestamps).any())):
        return None
    if new.shape[1] < max_new_tokens:
        new = torch.cat([new, new.new_full((new.shape[0], 1), gc.eos_token_id)], dim=1)
    return torch.cat([prompt.to(new.device), new], dim=1)


def target_generate_new_tokens(ft: FrozenTarget, inputs: dict, max_new_tokens: int, **generate_options) -> torch.Tensor:
    """The new tokens of `target_generate` (`[b, new]`, padded with the end token), where only they are needed
    (generated labels)."""
    prompt = inputs["decoder_input_ids"] if ft.is_encoder_decoder else inputs["input_ids"]
    return target_generate(ft, inputs, max_new_tokens, **generate_options)[:, prompt.shape[1] :]


def generated_labels(target: FrozenTarget, encoded: list[dict], max_new_tokens: int, device) -> list[torch.Tensor]:
    """The generated labels: the new tokens of the target's own generate (`target_generate_new_tokens`), one row
    per prompt, of batches of encoded prompts (processor outputs on the CPU, as
    `targets.families.registry.encode_batch` makes them): audio (features or waveform) goes to the target's dtype, ids
    and masks as they are, all to `device`."""
    rows = []
    for inputs in encoded:
        inputs = {k: v.to(device, target.model.dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
        rows.extend(target_generate_new_tokens(target, generate_kwargs(target.family, inputs), max_new_tokens))
    return rows


def target_transcripts(ft: FrozenTarget, processor, prompts: list[dict], max_new_tokens: int) -> list[str]:
    """The target's own greedy transcript of each prompt (`prompt_inputs` rows), special tokens skipped."""
    tokenizer = get_tokenizer(processor)
    out = []
    for prompt in prompts:
        new = target_generate_new_tokens(ft, generate_inputs(ft, prompt), max_new_tokens)
        out.append(tokenizer.decode(new[0], skip_special_tokens=True))
    return out


__all__ = [
    "generate_inputs",
    "generated_labels",
    "target_generate",
    "target_generate_new_tokens",
    "target_transcripts",
]
