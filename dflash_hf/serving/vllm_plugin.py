"""The vLLM plugin of dflash_hf: entry point `dflash_hf` of the group `vllm.general_plugins` (`register`).

vLLM's DFlash proposer reads the target's hidden states at the draft's taps through the target's `SupportsEagle3`
interface: it calls `set_aux_hidden_state_layers` with `i + 1` for each `dflash_config.target_layer_ids` entry `i`
(the input of decoder layer `i + 1` is the output of layer `i`, what the draft was trained on), and the target's
language model then returns those states beside its last hidden state. vLLM's Qwen3-ASR implements the interface;
its Qwen2-Audio, Voxtral, AudioFlamingo3 and GLM-ASR do not, although the language model inside each (vLLM's Qwen2 or
Llama decoder) already collects the states. `register` maps each of these architecture names to a variant of
vLLM's class that declares the interface (`dflash_hf.serving.vllm_models`), so their DFlash drafts serve unchanged.

vLLM's class of each family builds one fixed text model whatever the target's config says, and reads its own
checkpoint layout (`refusal` says what each needs). A target it would build wrongly is refused by name with a
one-line reason, never served silently: `register` also adds a check of the target's config to vLLM's per-architecture
config hooks (run when vLLM reads the config, before any weight loads), and the variants check it again when vLLM
builds them. The variants also rename, as the weights load, the language model's names in the layout transformers
5.17 to 5.22 save (`checkpoint_layout`), which vLLM's classes do not read.

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
# The text model vLLM 0.34's class builds for each architecture (`init_vllm_registered_model(...,
# architectures=[...])`), whatever `text_config.model_type` says: the `model_type` a target's text model must have.
TEXT_MODEL_BUILT: dict[str, tuple[str, str]] = {
    "Qwen2AudioForConditionalGeneration": ("qwen2", "Qwen2ForCausalLM"),
    "AudioFlamingo3ForConditionalGeneration": ("qwen2", "Qwen2ForCausalLM"),
    "GlmAsrForConditionalGeneration": ("llama", "LlamaForCausalLM"),
}
VOXTRAL = "VoxtralForConditionalGeneration"


def refusal(arch: str, config) -> str | None:
    """Why vLLM's class for `arch` cannot serve the target of `config` (its `hf_config`) as transformers runs it, in
    one line; None when it can."""
    if arch in TEXT_MODEL_BUILT:
        model_type, built = TEXT_MODEL_BUILT[arch]
        text_type = getattr(getattr(config, "text_config", None), "model_type", None)
        if text_type != model_type:
            return (
                f"vLLM's {arch} always builds its text model as {built}, but this target's text model is "
                f"{text_type!r}: vLLM would build a different network around its weights (a Llama inside Qwen2-Audio "
                f"gets Qwen2's q/k/v biases, left uninitialized). Decode this target with dflash_hf, or give it a "
                f"{model_type!r} text model"
            )
    if arch == VOXTRAL and getattr(getattr(config, "audio_config", None), "downsample_factor", None) is None:
        return (
            f"vLLM's {VOXTRAL} loads Mistral-format checkpoints only (params.json, consolidated.safetensors, "
            "tekken.json; --tokenizer-mode mistral --config-format mistral --load-format mistral), and this config "
            "was written by transformers (no audio_config.downsample_factor): vLLM cannot load it. Decode this "
            "target with dflash_hf"
        )
    return None


def check_servable(arch: str, config) -> None:
    """Raise ValueError with `refusal`'s reason when vLLM cannot serve the target of `config` faithfully."""
    reason = refusal(arch, config)
    if reason is not None:
        raise ValueError(f"dflash_hf: {reason}")


def variant_refs() -> dict[str, str]:
    """Architecture name -> `"<module>:<class>"` of its variant, the lazy form `ModelRegistry.register_model` takes
    (vLLM imports the class only when it builds that architecture, so registering initializes no device)."""
    return {arch: f"{VARIANTS_MODULE}:{variant}" for arch, (_, variant) in HIDDEN_STATE_VARIANTS.items()}


def _config_check(arch: str, previous: type | None, base: type) -> type:
    """A vLLM config hook for `arch` (`MODELS_CONFIG_MAP` entry): vLLM's own hook for it, if any, then `check_servable`
    on the target's config."""

    class ServableCheck(previous or base):
        dflash_hf_check = arch

        @classmethod
        def verify_and_update_model_config(cls, model_config) -> None:
            check_servable(arch, model_config.hf_config)
            super().verify_and_update_model_config(model_config)

    ServableCheck.__name__ = ServableCheck.__qualname__ = f"{arch}ServableCheck"
    return ServableCheck


def _add_config_checks(archs: list[str]) -> None:
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    for arch in archs:
        previous = MODELS_CONFIG_MAP.get(arch)
        if getattr(previous, "dflash_hf_check", None) != arch:
            MODELS_CONFIG_MAP[arch] = _config_check(arch, previous, VerifyAndUpdateConfig)


def register() -> list[str]:
    """Register the variants with vLLM's `ModelRegistry` under the architecture names vLLM itself uses, replacing its
    classes for them, and the config checks that refuse a target those classes would build wrongly. Architectures the
    installed vLLM does not serve are skipped. Idempotent (vLLM loads plugins in every process it starts). Returns the
    architecture names registered."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    registered = []
    for arch, ref in variant_refs().items():
        if arch in supported:
            ModelRegistry.register_model(arch, ref)
            registered.append(arch)
    _add_config_checks(registered)
    skipped = sorted(set(HIDDEN_STATE_VARIANTS) - set(registered))
    logger.info(
        "dflash_hf: DFlash drafts can serve %s (SupportsEagle3 variants; each target's config is checked: Qwen2-Audio "
        "and AudioFlamingo3 need a Qwen2 text model, GLM-ASR a Llama one, Voxtral a Mistral-format checkpoint)%s",
        ", ".join(registered) or "no architecture",
        f"; not in this vLLM: {', '.join(skipped)}" if skipped else "",
    )
    return registered


__all__ = [
    "ENTRY_POINT_GROUP",
    "ENTRY_POINT_NAME",
    "HIDDEN_STATE_VARIANTS",
    "TEXT_MODEL_BUILT",
    "check_servable",
    "refusal",
    "register",
    "variant_refs",
]
