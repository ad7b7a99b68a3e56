"""The vLLM plugin of dflash_hf: entry point `dflash_hf` of the group `vllm.general_plugins` (`register`).

vLLM's DFlash proposer reads the target's hidden states at the draft's taps through the target's `SupportsEagle3`
interface: it calls `set_aux_hidden_state_layers` with `i + 1` for each `dflash_config.target_layer_ids` entry `i`
(the input of decoder layer `i + 1` is the output of layer `i`, what the draft was trained on), and the target's
language model then returns those states beside its last hidden state. vLLM's Qwen3-ASR implements the interface;
its Qwen2-Audio, Voxtral, AudioFlamingo3 and GLM-ASR do not, although the language model inside each (vLLM's Qwen2 or
Llama decoder) already collects the states. `register` maps each of these architecture names to a variant of
vLLM's class that declares the interface (`dflash_hf.serving.vllm_models`), so their DFlash drafts serve unchanged.

Importing this module does not import vLLM; `register` does (vLLM calls it in each of its processes), and the
variants are imported only when vLLM builds one.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "dflash_hf"
VARIANTS_MODULE = "dflash_hf.serving.vllm_models"
# vLLM architecture name -> (the vLLM module defining its class, the name of our variant in VARIANTS_MODULE)
HIDDEN_STATE_VARIANTS: dict[str, tuple[str, str]] = {
    "Qwen2AudioForConditionalGeneration": (
        "vllm.model_executor.models.qwen2_audio",
        "Qwen2AudioForConditionalGenerationWithHiddenStates",
    ),
    "VoxtralForConditionalGeneration": (
        "vllm.model_executor.models.voxtral",
        "VoxtralForConditionalGenerationWithHiddenStates",
    ),
    "AudioFlamingo3ForConditionalGeneration": (
        "vllm.model_executor.models.audioflamingo3",
        "AudioFlamingo3ForConditionalGenerationWithHiddenStates",
    ),
    "GlmAsrForConditionalGeneration": (
        "vllm.model_executor.models.glmasr",
        "GlmAsrForConditionalGenerationWithHiddenStates",
    ),
}


def variant_refs() -> dict[str, str]:
    """Architecture name -> `"<module>:<class>"` of its variant, the lazy form `ModelRegistry.register_model` takes
    (vLLM imports the class only when it builds that architecture, so registering initializes no device)."""
    return {arch: f"{VARIANTS_MODULE}:{variant}" for arch, (_, variant) in HIDDEN_STATE_VARIANTS.items()}


def register() -> list[str]:
    """Register the variants with vLLM's `ModelRegistry` under the architecture names vLLM itself uses, replacing its
    classes for them. Architectures the installed vLLM does not serve are skipped. Idempotent (vLLM loads plugins in
    every process it starts). Returns the architecture names registered."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    registered = []
    for arch, ref in variant_refs().items():
        if arch in supported:
            ModelRegistry.register_model(arch, ref)
            registered.append(arch)
    skipped = sorted(set(HIDDEN_STATE_VARIANTS) - set(registered))
    logger.info(
        "dflash_hf: DFlash drafts can serve %s (SupportsEagle3 variants)%s",
        ", ".join(registered) or "no architecture",
        f"; not in this vLLM: {', '.join(skipped)}" if skipped else "",
    )
    return registered


__all__ = ["ENTRY_POINT_GROUP", "ENTRY_POINT_NAME", "HIDDEN_STATE_VARIANTS", "register", "variant_refs"]
