"""The transformers side of `vllm_parity.py`: the target's greedy `generate` and dflash_hf's speculative decoding
of the same requests."""

from __future__ import annotations

from serving_checks import transformers_greedy

from .arguments import ParityArguments
from .request_rows import load_audio, load_processor, read_requests, render, sampling_rate_of


def load_reference(args: ParityArguments):
    """The target as transformers runs it (`dflash_hf`'s frozen target, in `--precision`, on the GPU if there is one),
    and each request's inputs for its `generate`."""
    import torch

    from dflash_hf.generation.target_generate import generate_inputs
    from dflash_hf.targets.frozen import FrozenTarget, load_target

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = FrozenTarget(load_target(args.target, args.precision).to(device))
    processor, tokenizer = load_processor(args.target)
    prepared = []
    for row in read_requests(args.prompts, args.num_prompts):
        prompt = render(row, tokenizer, processor)
        if row.get("audio"):
            rate = sampling_rate_of(processor)
            inputs = processor(
                text=[prompt], audio=[load_audio(row["audio"], rate)], sampling_rate=rate, return_tensors="pt"
            )
        else:
            ids = torch.tensor([prompt])
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        prepared.append(generate_inputs(target, {k: v.to(device) for k, v in inputs.items()}))
    return target, prepared


def run_dflash_hf(args: ParityArguments, reference=None) -> list[dict]:
    """Per request: new token ids and acceptance lengths of `speculative_generate` (greedy), as dflash-eval decodes."""
    from dflash_hf.export.drafts import load_draft_strict
    from dflash_hf.generation.speculative import speculative_generate
    from dflash_hf.targets.frozen import resolve_dtype

    target, prepared = reference or load_reference(args)
    draft = load_draft_strict(args.draft).to(device=target.device, dtype=resolve_dtype(args.precision)).eval()
    results = []
    for inputs in prepared:
        out = speculative_generate(draft, target, args.max_new_tokens, **inputs)
        new = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        results.append({"token_ids": new, "acceptance_lengths": list(out.acceptance_lengths)})
    return results


def reference_greedy(args: ParityArguments, eos: set[int]) -> list[dict]:
    """transformers' greedy `generate` of the requests, run before any vLLM engine starts; the model is released
    after (vLLM takes its share of the GPU's memory)."""
    import gc

    import torch

    reference = load_reference(args)
    greedy = transformers_greedy(reference[0].model, reference[1], args.max_new_tokens, eos)
    del reference
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return greedy
