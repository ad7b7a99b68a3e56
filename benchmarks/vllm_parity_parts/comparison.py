"""The comparisons of `vllm_parity.py`: the target alone in vLLM against transformers, and vLLM with the draft
against vLLM alone and against dflash_hf."""

from __future__ import annotations

from serving_checks import compare_target

from .request_rows import load_processor


def strip_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """The new tokens without a final end token (vLLM and generate both keep it; counted once either way)."""
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def compare(alone: dict, drafted: dict, ours: list[dict] | None, eos: set[int]) -> dict:
    """Per-request parity: vLLM with the draft against vLLM alone (greedy), acceptance against dflash_hf's."""
    pairs = list(zip(alone["requests"], drafted["requests"]))
    mismatched = [
        i for i, (a, d) in enumerate(pairs) if strip_eos(a["token_ids"], eos) != strip_eos(d["token_ids"], eos)
    ]
    vllm_lengths = [n for _, d in pairs for n in d["acceptance_lengths"] or []]
    counters = drafted["spec_counters"]
    out = {
        "requests": len(pairs),
        "outputs_equal_to_vllm_greedy": len(pairs) - len(mismatched),
        "mismatched_requests": mismatched,
        "tau_vllm": mean(vllm_lengths),
        "tau_vllm_counters": 1 + counters["accepted_tokens"] / counters["drafts"] if counters.get("drafts") else None,
    }
    if ours is not None:
        ours_lengths = [n for r in ours for n in r["acceptance_lengths"]]
        same = [
            i
            for i, ((_, d), r) in enumerate(zip(pairs, ours))
            if d["acceptance_lengths"] is not None and d["acceptance_lengths"] == r["acceptance_lengths"]
        ]
        out.update(
            tau_dflash_hf=mean(ours_lengths),
            identical_acceptance_sequences=len(same),
            identical_acceptance_share=len(same) / len(pairs) if pairs else None,
            dflash_hf_outputs_equal_to_vllm_greedy=sum(
                strip_eos(a["token_ids"], eos) == strip_eos(r["token_ids"], eos) for (a, _), r in zip(pairs, ours)
            ),
        )
    return out


def eos_ids(target: str) -> set[int]:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(target).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = load_processor(target)[1].eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def target_summary(check: dict) -> str:
    """One line on the target-alone check."""
    return (
        f"target alone: {check['identical']}/{check['requests']} outputs identical to transformers' greedy; "
        f"divergences not explained by numerics: {check['divergences_not_numerics'] or 'none'}"
    )


def check_target(served: dict, greedy: list[dict], tie_margin: float, eos: set[int]) -> dict:
    """The target alone in vLLM (`served`: its pass with top log-probabilities) against transformers' greedy
    `generate`."""
    check = compare_target(served["requests"], greedy, tie_margin, lambda t: strip_eos(t, eos))
    check["serving_class"] = served["serving_class"]
    check["engine"] = served.get("engine")
    check["transformers_token_ids"] = [g["token_ids"] for g in greedy]
    check["vllm_token_ids"] = [r["token_ids"] for r in served["requests"]]
    return check
