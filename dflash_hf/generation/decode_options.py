"""How one decode runs, as one typed object: `DecodeOptions` (the draft's step and the target's verify as fixed-shape
forwards, CUDA graphs on a GPU; tree verification). The draft/verify loop, `DFlashCustomGenerate` and
`decode_benchmark` take it; `speculative_generate` and `dflash_custom_generate` also take its fields as keywords."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dflash_hf.generation.tree_decode import check_tree_budget
from dflash_hf.settings.decode import DecodeSettings


@dataclass(frozen=True)
class DecodeOptions:
    """`draft_cuda_graph` (greedy): None replays the draft's step as a CUDA graph on a GPU where the decode's positions
    are bounded, True also runs the fixed-shape step on the CPU, False keeps the eager draft forward
    (`dflash_hf.generation.fixed_draft`); the output is the same either way. `verify_cuda_graph` (greedy): the
    target's verify as a fixed-shape forward, the same three ways (`dflash_hf.generation.fixed_verify`; its logits
    equal the growing cache's up to rounding). `tree_budget`: None verifies the draft's chain (its top token at each
    slot); an int verifies a token tree of that many nodes a cycle in one target forward
    (`dflash_hf.generation.tree_decode`; lossless as the chain)."""

    draft_cuda_graph: bool | None = None
    verify_cuda_graph: bool | None = None
    tree_budget: int | None = None

    def __post_init__(self) -> None:
        for name in ("draft_cuda_graph", "verify_cuda_graph"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be None (where it can run), True or False, got {value!r}")
        check_tree_budget(self.tree_budget)

    @classmethod
    def from_settings(cls, settings: DecodeSettings, tree_budget: int | None = None) -> DecodeOptions:
        """The options of a command line's `DecodeSettings` (`auto | on | off` modes), with `tree_budget`."""
        return cls(**DecodeSettings.graph_modes(settings), tree_budget=tree_budget)

    @classmethod
    def of(
        cls,
        options: DecodeOptions | None,
        draft_cuda_graph: bool | None = None,
        verify_cuda_graph: bool | None = None,
        tree_budget: int | None = None,
    ) -> DecodeOptions:
        """`options`, or the options of the keywords when it is None; both given is an error naming the keywords."""
        if options is None:
            return cls(draft_cuda_graph, verify_cuda_graph, tree_budget)
        keywords = {
            "draft_cuda_graph": draft_cuda_graph,
            "verify_cuda_graph": verify_cuda_graph,
            "tree_budget": tree_budget,
        }
        given = [name for name, value in keywords.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} given beside options=DecodeOptions(...): set them in the options, or pass the "
                "keywords alone"
            )
        if not isinstance(options, DecodeOptions):
            raise TypeError(f"options must be a DecodeOptions, got {type(options).__name__}")
        return options

    def with_tree(self, tree_budget: int | None) -> DecodeOptions:
        """These options verifying trees of `tree_budget` nodes (None: the chain)."""
        return dataclasses.replace(self, tree_budget=tree_budget)


__all__ = ["DecodeOptions"]
