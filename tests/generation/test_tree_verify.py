"""The target's forward over a token tree (`generation.tree_verify`): each node's logits and taps are those of a plain
forward over its own path (the 4-D mask and the positions, a padded prompt's included), and after the accepted path
is kept the target's cache equals a fresh forward's over the committed tokens (growing cache, Whisper's
encoder-decoder cache, and the fixed-shape step's buffers); targets whose decoder cannot take the tree's mask are
refused before decoding."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, EncoderDecoderCache
from utils import REPO_ROOT, loaded_script, tiny_text_target, tiny_whisper, whisper_draft, whisper_features

from dflash_hf import DFlashConfig, DFlashDraftModel, speculative_generate
from dflash_hf.generation.decode_state import TargetVerifier, crop_cache
from dflash_hf.generation.fixed_verify import clear_fixed_verify_steps, verify_step_for
from dflash_hf.generation.prompt_padding import generate_positions, prompt_padding
from dflash_hf.generation.target_cache import cache_keyword
from dflash_hf.generation.tree import SlotScores, build_tree, tree_nodes, verify_inputs
from dflash_hf.generation.tree_verify import FixedTreeVerifyStep, cache_tensors, keep_path, verify_tree
from dflash_hf.targets.frozen import FrozenTarget

pytestmark = pytest.mark.compat  # run on every transformers version CI tests

TAPS = [1, 2]


def _tree(vocab: int, seed: int, depth: int = 3, budget: int = 12):
    logits = torch.randn(depth, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    return build_tree(*SlotScores(logits).candidates(4), tree_nodes(budget, depth, 4))


def _path(tree, node: int) -> list[int]:
    parents = [0, *tree.parents.tolist()]
    path = [node]
    while path[-1]:
        path.append(parents[path[-1]])
    return path[::-1]


def _off_chain_leaf(tree) -> int:
    """The deepest node whose path leaves the chain (nodes 1..D): its rows must be gathered."""
    depth = tree.depth.tolist()
    off = [n for n in range(1, len(depth)) if any(m > 3 for m in _path(tree, n))]
    return max(off, key=lambda n: (depth[n], -n))


class _TextCase:
    """A tiny text target, one prompt (optionally left-padded) after its prefill, and plain forwards to compare."""

    def __init__(self, padded: bool):
        self.model, _ = tiny_text_target(num_layers=3, hidden_size=32, seed=4)
        self.ft = FrozenTarget(self.model)
        ids = torch.randint(3, 250, (1, 8), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        if padded:
            mask[:, :3] = 0
        self.mask, self.prompt = mask, ids
        self.padding = prompt_padding(mask, None, ids.shape[1])
        self.verifier = TargetVerifier(self.ft, TAPS, "input_ids", DynamicCache(), padding=self.padding)
        extra = {} if self.padding is None else {"attention_mask": mask, "position_ids": generate_positions(mask)}
        self.verifier(input_ids=ids, **extra)
        self.step_kwargs = {}

    def plain(self, tokens: list[int]):
        """Logits, taps and cache of one forward over the prompt followed by `tokens`, as `generate` positions it."""
        ids = torch.cat([self.prompt, torch.tensor([tokens])], dim=1)
        mask = torch.cat([self.mask, torch.ones(1, len(tokens), dtype=torch.long)], dim=1)
        cache = DynamicCache()
        out, feats = self.ft.tapped_forward(
            TAPS,
            input_ids=ids,
            attention_mask=mask,
            position_ids=generate_positions(mask),
            **{cache_keyword(self.model): cache},
        )
        return out.logits[0], feats.taps, cache


class _WhisperCase:
    """The tiny Whisper, one utterance's encoder output and a decoder prompt after its prefill."""

    def __init__(self):
        self.model, processor = tiny_whisper()
        self.ft = FrozenTarget(self.model)
        with torch.no_grad():
            self.encoder = self.model.get_encoder()(whisper_features(processor, 0))
        self.prompt = torch.tensor([[self.model.generation_config.decoder_start_token_id, 5, 6, 7]])
        self.mask, self.padding = None, None
        self.step_kwargs = {"encoder_outputs": self.encoder}
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        self.verifier = TargetVerifier(self.ft, TAPS, "decoder_input_ids", cache, step_kwargs=self.step_kwargs)
        self.verifier(decoder_input_ids=self.prompt)

    def plain(self, tokens: list[int]):
        ids = torch.cat([self.prompt, torch.tensor([tokens])], dim=1)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        out, feats = self.ft.tapped_forward(
            TAPS,
            encoder_outputs=self.encoder,
            decoder_input_ids=ids,
            use_cache=True,
            **{cache_keyword(self.model): cache},
        )
        return out.logits[0], feats.taps, cache


CASES = {"text": lambda: _TextCase(False), "left-padded text": lambda: _TextCase(True), "whisper": _WhisperCase}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fixed", [False, True])
def test_each_node_sees_its_path_and_the_kept_cache_is_the_committed_sequence(case, fixed):
    c = CASES[case]()
    torch.manual_seed(0)
    vocab = c.ft.vocab_size
    tree = _tree(vocab, seed=3)
    a, anchor = c.prompt.shape[1], 11
    ids = torch.cat([torch.tensor([[anchor]]), tree.tokens[None]], dim=1)
    with torch.no_grad():
        if fixed:
            clear_fixed_verify_steps(c.model)
            step = verify_step_for(
                c.ft, TAPS, tree.nodes + 1, 64, c.verifier.cache, c.step_kwargs, False, padding=c.padding,
                kind=FixedTreeVerifyStep,
            )  # fmt: skip
            logits, feats = step.verify_tree_inputs(c.ft, verify_inputs(torch.tensor(anchor), tree), a)
        else:
            logits, feats = verify_tree(c.verifier, ids, tree.depth, tree.ancestors, a)
        tokens = [anchor, *tree.tokens.tolist()]
        for node in range(tree.nodes + 1):  # each node's row: a plain forward over its path
            path = _path(tree, node)
            ref_logits, ref_taps, _ = c.plain([tokens[n] for n in path])
            torch.testing.assert_close(logits[node], ref_logits[-1], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(feats[0, node], ref_taps[0, -1], atol=2e-5, rtol=1e-4)
        nodes = torch.tensor(_path(tree, _off_chain_leaf(tree)))
        k = nodes.shape[0] - 1
        assert k >= 2 and nodes.tolist() != list(range(k + 1))
        keep_path(step.key_values() if fixed else cache_tensors(c.verifier.cache), a, nodes)
        if not fixed:
            crop_cache(c.verifier.cache, a + k + 1)
        layers = zip(step.self_cache.keys, step.self_cache.values) if fixed else None
        kept = [t for pair in layers for t in pair] if fixed else cache_tensors(c.verifier.cache)
        _, _, fresh = c.plain([tokens[n] for n in nodes.tolist()])
        for ours, theirs in zip(kept, cache_tensors(fresh)):
            if fixed:
                ours = ours[:, :, : a + k + 1]
            if c.padding is not None:  # the padding's rows are masked, whatever they hold
                ours, theirs = ours[:, :, 3:], theirs[:, :, 3:]
            assert ours.shape == theirs.shape
            torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
        if case == "whisper" and not fixed:  # the cross-attention cache stays the utterance's
            assert c.verifier.cache.cross_attention_cache.get_seq_length() == c.encoder[0].shape[1]


def _draft_for(model):
    ft = FrozenTarget(model)
    cfg = DFlashConfig.from_target_config(ft.text_config, mask_token_id=3, num_hidden_layers=1, block_size=4)
    cfg.vocab_size = ft.vocab_size
    torch.manual_seed(0)
    return DFlashDraftModel(cfg).eval()


def test_targets_that_cannot_take_a_tree_mask_are_refused_before_decoding():
    model, _ = tiny_text_target(num_layers=2, hidden_size=32)
    draft, ids = _draft_for(model), torch.tensor([[5, 6, 7]])
    for budget in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="tree_budget must be"):
            speculative_generate(draft, model, 4, tree_budget=budget, input_ids=ids)
    config = model.config
    for field, value, message in (
        ("_attn_implementation", "flash_attention_2", "attn_implementation 'flash_attention_2'"),
        ("sliding_window", 4, "sliding-window"),
        ("rope_parameters", {"rope_type": "default", "mrope_section": [2, 1, 1]}, "multimodal"),
    ):
        saved = getattr(config, field)
        try:
            object.__setattr__(config, field, value) if field.startswith("_") else setattr(config, field, value)
            if field == "sliding_window":
                config.use_sliding_window = True
            with pytest.raises(ValueError, match=f"tree_budget: .*{message}"):
                speculative_generate(draft, model, 4, tree_budget=8, input_ids=ids)
        finally:
            object.__setattr__(config, field, saved) if field.startswith("_") else setattr(config, field, saved)
    out = speculative_generate(draft, model, 4, tree_budget=8, input_ids=ids)
    assert out.sequences.shape[1] == 7


def test_the_fixed_shape_verify_of_a_tree_is_refused_where_the_chain_is():
    model, processor = tiny_whisper()
    feats = whisper_features(processor, 0)
    with pytest.raises(ValueError, match=r"verify_cuda_graph=True: .* not sampling"):
        speculative_generate(
            whisper_draft(model), model, 8, 1.0, verify_cuda_graph=True, tree_budget=8, input_features=feats
        )
    with loaded_script(REPO_ROOT / "tests" / "targets" / "test_moonshine.py") as moonshine:
        model, processor = moonshine.build_moonshine()
        draft = moonshine._draft(FrozenTarget(model), processor)
        values = torch.from_numpy(moonshine._audio(0, 0.5))[None]
    with pytest.raises(ValueError, match="verify_cuda_graph=True: .* an encoder-decoder target other than Whisper"):
        speculative_generate(draft, model, 8, verify_cuda_graph=True, tree_budget=8, input_values=values)


def test_the_capture_of_a_tree_verify_stays_within_whispers_positions(monkeypatch):
    """A CUDA graph is captured at the buffers' last rows (written again before any query reaches them); a tree step's
    rows run past Whisper's 448 positions, so its capture forward must take positions from 0 (here the capture is
    the plain forward, as on the CPU there is no graph)."""
    from dflash_hf.generation import fixed_verify

    monkeypatch.setattr(fixed_verify, "capture_graph", lambda device, step, pool=None: (None, step()))
    c = _WhisperCase()
    tree = _tree(c.ft.vocab_size, seed=5)
    rows = fixed_verify.verify_rows(None, 448, 0, tree.nodes + 1)
    assert rows > 448
    with torch.no_grad():
        step = verify_step_for(
            c.ft, TAPS, tree.nodes + 1, rows, c.verifier.cache, c.step_kwargs, True, kind=FixedTreeVerifyStep
        )
        ids = torch.cat([torch.tensor([[11]]), tree.tokens[None]], dim=1)
        fixed, _ = step.verify_tree_inputs(c.ft, verify_inputs(ids[0, 0], tree), c.prompt.shape[1])
        eager, _ = verify_tree(c.verifier, ids, tree.depth, tree.ancestors, c.prompt.shape[1])
    torch.testing.assert_close(fixed, eager, atol=2e-5, rtol=1e-4)
    clear_fixed_verify_steps(c.model)
