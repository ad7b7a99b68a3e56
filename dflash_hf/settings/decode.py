"""The decoding switches of `dflash-eval` and the decoding benchmarks: the draft's step and the target's verify as
fixed-shape forwards, replayed as CUDA graphs on a GPU (`--draft_cuda_graph`, `--verify_cuda_graph`: auto, on or
off). `dflash_hf.generation.decode_options.DecodeOptions.from_settings` turns them into what `speculative_generate`
takes. Light: no torch, no transformers."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_hf.settings.checks import Settings, setting

# a command line's mode -> `speculative_generate`'s tri-state (None: where it can run, True: always, False: never)
GRAPH_MODES = {"auto": None, "on": True, "off": False}


def graph_mode(value: str, field: str) -> bool | None:
    """Option `field`'s `auto | on | off` as `speculative_generate`'s tri-state (None, True, False)."""
    if value not in GRAPH_MODES:
        raise ValueError(f"--{field} must be one of {sorted(GRAPH_MODES)}, got {value!r}")
    return GRAPH_MODES[value]


@dataclass(kw_only=True)
class DecodeSettings(Settings):
    """How the decoding steps run: the decoded output is the same in every mode (the verify's logits equal the
    growing cache's up to rounding; outputs are checked against greedy as usual)."""

    draft_cuda_graph: str = setting(
        "auto",
        "auto: on a GPU, replay the draft's greedy step as a CUDA graph (generation.fixed_draft); "
        "off: the eager draft forward; on: also the fixed-shape step on the CPU. The decoded "
        "output is the same in every mode.",
    )
    verify_cuda_graph: str = setting(
        "auto",
        "auto: on a GPU, the target's greedy verify as a fixed-shape forward replayed as a CUDA "
        "graph where it can run (Whisper and decoder-only targets, SDPA or eager attention; "
        "dflash_hf.generation.fixed_verify), else the growing cache; on: always (refused where it cannot run; "
        "on the CPU without a graph); off: the growing cache. Its logits equal the growing cache's "
        "up to rounding; outputs are checked against greedy as usual.",
    )

    @classmethod
    def validate(cls, values) -> None:
        super().validate(values)
        cls.graph_modes(values)  # a bad mode is an error naming its flag

    @staticmethod
    def graph_modes(values) -> dict[str, bool | None]:
        """`draft_cuda_graph` and `verify_cuda_graph` of `values` as `speculative_generate` takes them."""
        return {name: graph_mode(getattr(values, name), name) for name in ("draft_cuda_graph", "verify_cuda_graph")}


__all__ = ["GRAPH_MODES", "DecodeSettings", "graph_mode"]
