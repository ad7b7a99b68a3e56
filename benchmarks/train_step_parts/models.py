"""The random-weight target of a shape, the fixed-taps target of mode `draft`, and what a step's memory holds."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3ASRConfig,
    Qwen3ASRForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

from dflash_hf.targets.frozen import FrozenTarget, TargetFeatures

from .shapes import DECODER_DIMS


def _random_init(cls, config, dtype: torch.dtype, device: torch.device):
    """`cls(config)` with random weights, built directly in `dtype` on `device`, frozen (eval, no grad)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def build_target(shape: dict, dtype: torch.dtype, device: torch.device):
    """The frozen target of `shape` with random weights (sdpa attention, as training loads it)."""
    kind = shape.get("kind", "qwen3")
    if kind == "qwen3":
        tcfg = Qwen3Config(
            **{k: shape[k] for k in DECODER_DIMS},
            max_position_embeddings=32768,
            tie_word_embeddings=False,
            pad_token_id=0,
            eos_token_id=1,
            attn_implementation="sdpa",
        )
        return _random_init(Qwen3ForCausalLM, tcfg, dtype, device)
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "whisper": (WhisperConfig, WhisperForConditionalGeneration),
        "qwen3_asr": (Qwen3ASRConfig, Qwen3ASRForConditionalGeneration),
    }[kind]
    return _random_init(model_cls, config_cls(**shape["config"], attn_implementation="sdpa"), dtype, device)


class FixedTapsTarget(FrozenTarget):
    """The frozen target with its forward replaced by fixed random taps (one tensor per decoder-stream shape,
    made before timing): times the draft side alone."""

    def __init__(self, model, taps: dict[tuple[int, int], torch.Tensor]):
        super().__init__(model)
        self.taps = taps

    def capture(self, batch, layer_ids, keep_final=False, padded=None, host=None) -> TargetFeatures:
        return TargetFeatures(taps=self.taps[tuple(batch["input_ids"].shape)], final_hidden=None)


def _gib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**30


def memory_breakdown(tmodel, ft: FrozenTarget, draft, optimizer, mode: str, taps: dict | None, peak: float) -> dict:
    """What the peak holds (GiB), from the sizes of the tensors themselves: the frozen target's decoder layers and
    its other weights (embeddings, lm_head, audio encoder), the draft's weights, gradients (one per trainable
    weight) and optimizer states, the fixed taps of the draft side, and the rest of the peak (activations,
    temporaries, workspaces; CUDA only). The draft side never runs the target's decoder layers:
    `draft_side_peak_without_target_layers` is the peak a trainer holding only what the draft side uses would see."""
    layers = _gib(p for layer in ft.layers for p in layer.parameters())
    target = _gib(tmodel.parameters())
    draft_w = _gib(draft.parameters())
    grads = _gib(p for p in draft.parameters() if p.requires_grad)
    states = _gib(v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    taps_gib = _gib(taps.values()) if taps else 0.0
    out = {
        "target_decoder_layers": layers,
        "target_other": target - layers,
        "draft_weights": draft_w,
        "draft_grads": grads,
        "optimizer_states": states,
        "fixed_taps": taps_gib,
    }
    if peak:
        out["activations_and_rest"] = peak - sum(out.values())
        if mode == "draft":
            out["draft_side_peak_without_target_layers"] = peak - layers
    return {k: round(v, 6) for k, v in out.items()}
