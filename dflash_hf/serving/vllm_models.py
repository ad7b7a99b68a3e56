"""Variants of vLLM's audio LLMs that implement vLLM's `SupportsEagle3` hidden-state interface (imports vLLM).

Each variant is vLLM's own class (its weights, processor and forward unchanged) with `SupportsEagle3` added, as
vLLM's Qwen3-ASR has it: vLLM then asks the language model for the hidden states at the draft's taps
(`set_aux_hidden_state_layers`), and the language model's forward returns them beside its last hidden state. Its
constructor first refuses a target that vLLM's class would build wrongly (`vllm_plugin.check_servable`); its
`load_weights` renames the weights of the layout transformers 5.17 to 5.22 save to the names vLLM's class reads
(`checkpoint_layout.renamed_weights`) as they stream into vLLM's own `load_weights`. A variant is built the first
time its name is looked up in this module (`vllm_plugin.HIDDEN_STATE_VARIANTS`), so a vLLM without one of the base
architectures still imports this module.
"""

from __future__ import annotations

import importlib

from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3

from dflash_hf.serving.checkpoint_layout import renamed_weights
from dflash_hf.serving.vllm_plugin import HIDDEN_STATE_VARIANTS, check_servable


def _decoder(model):
    """The decoder of `model`'s language model, where `SupportsEagle3` sets the layers whose states are kept."""
    language_model = model.get_language_model() if hasattr(model, "get_language_model") else model.language_model
    return getattr(language_model, "model", language_model)


class HiddenStatesForDFlash(SupportsEagle3):
    """`SupportsEagle3` for a multimodal model whose language model collects hidden states (vLLM's
    `EagleModelMixin`); the layers asked for are checked against the decoder's."""

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        decoder = _decoder(self)
        name = type(self).__name__
        if not isinstance(decoder, EagleModelMixin):
            raise RuntimeError(
                f"{name}: the language model's decoder ({type(decoder).__name__}) does not collect hidden states "
                "(vLLM's EagleModelMixin); this vLLM cannot serve DFlash drafts for this target"
            )
        num_layers = len(decoder.layers)
        bad = sorted(i for i in layers if not 0 <= i <= num_layers)
        if bad:
            raise ValueError(
                f"{name}: hidden states after layers {[i - 1 for i in bad]} were asked for (vLLM asks for each "
                f"dflash_config.target_layer_ids entry + 1), but the target has {num_layers} decoder layers: the "
                "draft was trained for another target"
            )
        super().set_aux_hidden_state_layers(layers)


def _variant(name: str) -> type:
    for arch, (module, variant) in HIDDEN_STATE_VARIANTS.items():
        if variant == name:
            base = getattr(importlib.import_module(module), arch)

            def __init__(self, *, vllm_config, prefix: str = "", _arch=arch, _base=base):
                check_servable(_arch, vllm_config.model_config.hf_config)
                _base.__init__(self, vllm_config=vllm_config, prefix=prefix)

            def load_weights(self, weights, _arch=arch, _base=base):
                return _base.load_weights(self, renamed_weights(_arch, weights))

            doc = f"vLLM's `{arch}` with `SupportsEagle3`, so DFlash drafts serve with it (dflash_hf)."
            attrs = {"__module__": __name__, "__doc__": doc, "__init__": __init__, "load_weights": load_weights}
            return type(name, (base, HiddenStatesForDFlash), attrs)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __getattr__(name: str) -> type:
    cls = globals()[name] = _variant(name)
    return cls
