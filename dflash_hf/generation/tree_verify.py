"""The target's forward over a token tree (DESIGN section 9): every node in one forward, each attending to the
committed context and to its own ancestors only, at the root's position plus its depth; afterwards the target's
cache keeps the context and exactly the accepted nodes, in path order.

- Attention: a 4-D additive mask `[1, 1, N+1, a+N+1]` over the cache rows (the context's `a` rows, a padded prompt's
  padding masked, then the tree's `N+1` rows). transformers' mask helpers pass a 4-D mask to the layers unchanged
  (`masking_utils._preprocess_mask_arguments`), so SDPA and eager attention take it as it is; flash attention takes
  no such mask and a sliding window's band or a multimodal rope's 3-D positions would be lost: those targets are
  refused (:func:`check_tree_target`).
- Positions: the root's decoder position (its cache row, plus a padded prompt's offset) plus the node's depth, under
  the decoder's own keywords (`position_ids`, or `decoder_position_ids` for Whisper and Moonshine); Whisper's learned
  positions and the speech LLMs' 1-D rope read them as they read a chain's.
- The cache: the tree's rows are written at rows `a .. a+N` whatever the nodes' depths; the accepted path's rows are
  gathered into rows `a+1 .. a+k` of every layer (self-attention only: an encoder-decoder's cross-attention cache is
  the utterance's) and the rest cropped (:func:`keep_path`). The fixed-shape verify (:class:`FixedTreeVerifyStep`)
  does the same in its fixed buffers, masking the rows past the next anchor instead of cropping them.
"""

from __future__ import annotations

import torch

from dflash_hf.generation.fixed_verify import FixedVerifyStep, additive_mask
from dflash_hf.models.configuration_dflash import decoder_attends_fully

TREE_ATTENTION = ("sdpa", "eager")  # attention implementations that take a 4-D additive mask as given


def check_tree_target(ft) -> None:
    """Refuse tree verification for a target whose decoder cannot take the tree's mask and positions as given."""
    config = ft.decoder.config
    attention = getattr(config, "_attn_implementation", None)
    if attention not in TREE_ATTENTION:
        raise ValueError(
            f"tree_budget: tree verification attends through a 4-D mask, which attn_implementation {attention!r} "
            "does not take; load the target with attn_implementation='sdpa' or 'eager', or pass tree_budget=None"
        )
    if not decoder_attends_fully(config):
        raise ValueError(
            "tree_budget: the target's decoder has sliding-window or non-attention layers, whose masks a tree's "
            "4-D mask would replace; pass tree_budget=None (chain verification)"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("mrope_section") is not None:
        raise ValueError(
            "tree_budget: the target's decoder takes multimodal (3-D) rope positions, which tree verification does "
            "not build; pass tree_budget=None (chain verification)"
        )


def tree_mask(context: torch.Tensor | None, ancestors: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive `[1, 1, N+1, rows+N+1]`: node n attends to the `rows` context rows (those `context` `[rows]` keeps,
    all if None) and to its `ancestors` `[N+1, N+1]` row."""
    n = ancestors.shape[0]
    keep_context = ancestors.new_ones(n, rows) if context is None else context[:rows].bool()[None, :].expand(n, rows)
    return additive_mask(torch.cat([keep_context, ancestors], dim=1), dtype)


def verify_tree(verifier, ids: torch.Tensor, depth: torch.Tensor, ancestors: torch.Tensor, a: int):
    """The target's forward over the tree's `ids` `[1, N+1]` (the root first) at cache rows `a ..`, over the growing
    cache: `depth` `[N+1]` the nodes' depths (capped where the decoder's positions end). Returns logits `[N+1, V]`
    and taps `[1, N+1, T*H]`."""
    padding, prefix = verifier.padding, "decoder_" if verifier.ids_key.startswith("decoder_") else ""
    context, offset = None, 0
    if padding is not None:
        context, offset = padding.verify_kwargs(a, a)["attention_mask"][0], padding.offset
    mask = tree_mask(context, ancestors, a, verifier.target.dtype)
    return verifier(
        **{
            verifier.ids_key: ids,
            f"{prefix}position_ids": (depth + (a + offset))[None],
            f"{prefix}attention_mask": mask,
        }
    )


def keep_path(tensors: list[torch.Tensor], a: int, nodes: torch.Tensor) -> None:
    """Copy the rows of the path's nodes (`nodes` `[k+1]`, the root first, at rows `a + node`) to rows `a+1 .. a+k`
    of every key/value tensor `[..., rows, head_dim]`."""
    k = nodes.shape[0] - 1
    if k:
        for t in tensors:  # node n's row is row n of the rows from `a` (a view: no offset added)
            t[..., a + 1 : a + 1 + k, :] = t[..., a:, :].index_select(-2, nodes[1:])


def cache_tensors(cache) -> list[torch.Tensor]:
    """The self-attention keys and values of every layer of a transformers cache (an encoder-decoder cache's
    self-attention part)."""
    cache = getattr(cache, "self_attention_cache", cache)
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


class FixedTreeVerifyStep(FixedVerifyStep):
    """The fixed-shape verify of a token tree of `block` nodes (the root included; `fixed_verify`'s step for its
    buffers, prompt rows and CUDA graph): the nodes' ids, depths and ancestors (one tensor, `tree.verify_inputs`) and
    the root's row are copied into fixed tensors before each replay; the nodes are written at rows `root ..`, at
    positions `root + shift + depth` (`shift` 0: the root's position is its row; but for the capture, which writes the
    last rows at the first positions, within Whisper's learned ones). Its decodes' blocks stay within the decoder's
    positions (`fixed_verify.verify_step_blocker`): the depths need no cap."""

    def _build(self, ft, layer_ids, block, rows, prefill_cache, encoder_hidden, graph) -> None:
        dev = ft.device
        self.inputs = torch.cat(  # [N+1, N+3]: ids, depth, ancestors (`tree.verify_inputs`)
            [torch.zeros(block, 2, dtype=torch.long, device=dev), torch.eye(block, dtype=torch.long, device=dev)], 1
        )
        self.root = torch.zeros((), dtype=torch.long, device=dev)
        self.shift = torch.zeros((), dtype=torch.long, device=dev)
        super()._build(ft, layer_ids, block, rows, prefill_cache, encoder_hidden, graph)

    def _inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        columns, n = self.self_cache.columns, self.block
        self.ids.copy_(self.inputs[None, :, 0])
        ancestors = self.inputs[:, 2:] != 0
        relative = columns - self.root
        inside = (relative >= 0) & (relative < n)
        tree = ancestors.gather(1, relative.clamp(0, n - 1)[None, :].expand(n, -1)) & inside[None, :]
        keep = ((columns < self.root) & self.valid)[None, :] | tree
        return self.root + self.base, self.root + self.shift + self.inputs[:, 1], additive_mask(keep, self.dtype)

    def _capture(self, ft, at: int) -> None:
        self.root.fill_(at)
        self.shift.fill_(-at)
        super()._capture(ft, at)
        self.shift.fill_(0)

    def verify_tree_inputs(self, ft, inputs: torch.Tensor, a: int):
        """Logits `[N+1, V]` and taps `[1, N+1, T*H]` of the tree whose `inputs` (`tree.verify_inputs`) are given, at
        rows `a ..` (fixed tensors the next call overwrites)."""
        self.inputs.copy_(inputs)
        self.root.fill_(a)
        return self._run(ft)

    def key_values(self) -> list[torch.Tensor]:
        """The fixed buffers: one tensor `[2, layers, 1, heads, rows, head_dim]` (a path's rows move in one copy)."""
        return [self.self_cache.storage]


__all__ = [
    "FixedTreeVerifyStep",
    "cache_tensors",
    "check_tree_target",
    "keep_path",
    "tree_mask",
    "verify_tree",
]
