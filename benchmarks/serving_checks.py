"""What `vllm_parity.py` records beside its draft rows: the versions and the vLLM class that served the target (the
plugin's evidence), and the target-alone check: the target in vLLM against transformers' greedy `generate` on the
same prompts.

Target check, per request: whether the new tokens are identical; if not, the first position where they differ, and at
that position the two logits margins: transformers' logit of its own token minus its logit of vLLM's token (from
`generate`'s logits), and vLLM's log-probability of its token minus that of transformers' (from vLLM's top
log-probabilities, where transformers' token is among them). Where one side stopped there (its output without end
token ends at that position), its token is the end token it chose (`ended` names that side), compared like any other
token; an output that ran out at `max_new_tokens` has no token there, and no margin. A divergence whose transformers
margin is at most `tie_margin` (a near tie, which rounding decides) counts as numerics; any other divergence (no
margin: a token outside transformers' top 8, an output cut by `max_new_tokens`) means vLLM computes another function
than transformers does (a wrongly built or loaded target), and the check fails.
"""

from __future__ import annotations

import importlib.util
import os
from importlib.metadata import PackageNotFoundError, entry_points, version

# transformers' logit margin up to which a first divergence counts as a near tie (rounding), by precision
TIE_MARGIN = {"fp32": 1e-3, "bf16": 0.25}
TOP_LOGPROBS = 2  # log-probabilities vLLM returns per position in the target check


def versions() -> dict[str, str]:
    """The installed versions of vLLM, torch, transformers and dflash_hf. A dflash_hf imported without being installed
    (a checkout on the path) reads `<version> (not installed)`: its vLLM plugin's entry point is then absent."""
    out = {}
    for name in ("vllm", "torch", "transformers", "dflash_hf"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    if out["dflash_hf"] == "not installed":
        import dflash_hf

        out["dflash_hf"] = f"{dflash_hf.__version__} (not installed)"
    return out


def vllm_environment() -> dict[str, str]:
    """Environment the vLLM workers need here: without FlashInfer (requirements-serving.txt leaves it out: vLLM
    0.34.0 pins a release PyPI lacks), vLLM's sampler must be told not to import it."""
    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return {k: os.environ[k] for k in ("VLLM_USE_FLASHINFER_SAMPLER", "VLLM_PLUGINS") if k in os.environ}


def serving_class(llm) -> dict:
    """The class vLLM's `ModelRegistry` resolves for the target it serves (in the engine's own process, after vLLM
    loaded its general plugins), and the plugins installed: the evidence that the plugin's variant served it."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    config = llm.llm_engine.model_config
    cls, arch = ModelRegistry.resolve_model_cls(config.architectures, config)
    return {
        "architecture": arch,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "dflash_hf_plugin": cls.__module__.startswith("dflash_hf."),
        "supports_eagle3": bool(supports_eagle3(cls)),
        "general_plugins": sorted(f"{p.name} = {p.value}" for p in entry_points(group="vllm.general_plugins")),
    }


def top_logprobs(completion) -> list[list[list[float]]] | None:
    """Per new token, vLLM's `[token_id, logprob]` pairs (its top ones and the chosen token)."""
    if completion.logprobs is None:
        return None
    return [[[int(t), float(lp.logprob)] for t, lp in position.items()] for position in completion.logprobs]


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's end counts), None if equal."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def token_at(raw: list[int], stripped: list[int], at: int) -> tuple[int | None, bool]:
    """A side's token at a first divergence and whether it is the end token that `strip` removed (the side stopped
    there); None where the output ran out before `at` (cut by `max_new_tokens`)."""
    if at < len(stripped):
        return stripped[at], False
    return (raw[at], True) if at < len(raw) else (None, False)


def compare_target(vllm_requests: list[dict], hf_requests: list[dict], tie_margin: float, strip) -> dict:
    """The target-alone check (module docstring): vLLM's requests (`token_ids`, `top_logprobs`) against transformers'
    (`token_ids`, `logits_at` {position: {token_id: logit}}). `strip` removes a final end token from an output; the
    first divergence is that of the stripped outputs."""
    rows = []
    for i, (v, h) in enumerate(zip(vllm_requests, hf_requests, strict=True)):
        vt, ht = strip(v["token_ids"]), strip(h["token_ids"])
        at = first_divergence(ht, vt)
        row = {"request": i, "identical": at is None}
        if at is not None:
            row["first_divergence"] = at
            hf_tok, hf_ended = token_at(h["token_ids"], ht, at)
            vllm_tok, vllm_ended = token_at(v["token_ids"], vt, at)
            row.update(transformers_token=hf_tok, vllm_token=vllm_tok)
            if hf_ended or vllm_ended:
                row["ended"] = "transformers" if hf_ended else "vllm"
            # no margin between a token and itself (one side went on past the end token the other stopped at)
            pair = hf_tok is not None and vllm_tok is not None and hf_tok != vllm_tok
            logits = h.get("logits_at", {}).get(str(at)) or h.get("logits_at", {}).get(at)
            if logits is not None and pair:  # None: vLLM's token is not among transformers' top 8 there
                theirs = logits.get(str(vllm_tok))
                row["transformers_margin"] = None if theirs is None else logits[str(hf_tok)] - theirs
            lps = v.get("top_logprobs") or []
            if pair and at < len(lps) and lps[at]:
                found = dict((int(t), lp) for t, lp in lps[at])
                if hf_tok in found:
                    row["vllm_margin"] = found[vllm_tok] - found[hf_tok]
            margin = row.get("transformers_margin")
            row["numerics"] = margin is not None and abs(margin) <= tie_margin
        rows.append(row)
    identical = sum(r["identical"] for r in rows)
    unexplained = [r["request"] for r in rows if not r["identical"] and not r["numerics"]]
    return {
        "requests": len(rows),
        "identical": identical,
        "identical_share": identical / len(rows) if rows else None,
        "tie_margin": tie_margin,
        "divergences_not_numerics": unexplained,
        "passed": not unexplained,
        "per_request": rows,
    }


def transformers_greedy(target, prepared: list[dict], max_new_tokens: int, eos: set[int]) -> list[dict]:
    """transformers' plain greedy `generate` per request (no repetition penalty or other processor of the target's
    generation config: vLLM's greedy has none), with each step's logits of its top 8 tokens and of the token chosen
    (`logits_at`, for the margins of `compare_target`)."""
    import torch
    from transformers import GenerationConfig

    eos_list = sorted(eos)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_list or None,
        pad_token_id=eos_list[0] if eos_list else None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    out = []
    with torch.no_grad():
        for inputs in prepared:
            gen = target.generate(**inputs, generation_config=config)
            new = gen.sequences[0, inputs["input_ids"].shape[1] :].tolist()
            logits_at = {}
            for step, logits in enumerate(gen.logits):
                row = logits[0].float()
                keep = set(torch.topk(row, 8).indices.tolist()) | {new[step]}
                logits_at[str(step)] = {str(t): float(row[t]) for t in sorted(keep)}
            out.append({"token_ids": new, "logits_at": logits_at})
    return out
