"""`target_cuda_graph`: when the frozen target's training forward is captured, which batches replay a graph, and how
a failed capture falls back. The capture itself needs a GPU (tests/gpu/test_gpu.py checks that a replay gives the
eager features bit for bit); here the graph is replaced by a stand-in that records what it was asked to do."""

from __future__ import annotations

import logging

import pytest
import torch
from utils import make_trainer, random_rows, text_batch, tiny_text_target, tiny_whisper

from dflash_hf import target_graph
from dflash_hf.target import FrozenTarget
from dflash_hf.target_graph import TargetForwardGraphs, forward_graphs, graph_blocker

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


class StandIn:
    """A `CapturedForward` that runs the eager forward on replay (and counts captures)."""

    made: list = []

    def __init__(self, ft, batch, layer_ids, keep_final, padded, pool):
        self.run = lambda b: ft.features(b, layer_ids, keep_final, padded)
        StandIn.made.append(tuple(batch["input_ids"].shape))

    def replay(self, batch):
        return self.run(batch)


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr(target_graph, "CapturedForward", StandIn)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    StandIn.made = []
    return TargetForwardGraphs(None)


def _batch(tok, rows: int, seed: int) -> dict:
    return text_batch([(p[:4], r[:8]) for p, r in random_rows(rows, 250, seed=seed)], tok.pad_token_id)


def test_a_signature_is_captured_at_its_second_sighting_and_replayed_after(graphs):
    model, tok = tiny_text_target()
    ft = FrozenTarget(model)
    ft.forward_graphs = graphs
    three, two = _batch(tok, 3, 0), _batch(tok, 2, 1)
    for batch, padded in ((three, False), (two, False), (three, False), (three, False), (three, True)):
        got = ft.capture(batch, [0, 2], keep_final=True, padded=padded)
        ref = ft.features(batch, [0, 2], keep_final=True, padded=padded)
        assert torch.equal(got.taps, ref.taps) and torch.equal(got.final_hidden, ref.final_hidden)
    # [3, 12] captured at its second sighting and replayed at its third; [2, 12] and the padded key seen once
    assert StandIn.made == [(3, 12)] and graphs.replays == 2 and len(graphs.graphs) == 1
    ft.capture(three, [1, 2], keep_final=True, padded=False)  # other taps: another signature
    assert graphs.replays == 2


def test_at_most_max_graphs_are_kept_least_recently_used_first(graphs, monkeypatch):
    monkeypatch.setattr(target_graph, "MAX_GRAPHS", 2)
    model, tok = tiny_text_target()
    ft = FrozenTarget(model)
    ft.forward_graphs = graphs
    batches = [_batch(tok, n, n) for n in (1, 2, 3)]
    for batch in batches[:2] * 2 + batches[:1] + batches[2:] * 2:
        ft.capture(batch, [0], padded=False)
    assert [k[0][1][1][0] for k in graphs.graphs] == [1, 3]  # rows of input_ids: [2, 12] was dropped


def test_a_failed_capture_falls_back_to_the_eager_forward_for_good(graphs, monkeypatch, caplog):
    def fails(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(target_graph, "CapturedForward", fails)
    model, tok = tiny_text_target()
    ft = FrozenTarget(model)
    ft.forward_graphs = graphs
    batch = _batch(tok, 2, 0)
    with caplog.at_level(logging.WARNING, logger="dflash_hf.draft_graph"):
        for _ in range(3):
            ref = ft.features(batch, [0])
            assert torch.equal(ft.capture(batch, [0], padded=False).taps, ref.taps)
    assert "target_cuda_graph=false skips the attempt" in caplog.text and caplog.text.count("could not run") == 1
    assert ft.model in target_graph._FAILED
    ft.forward_graphs = TargetForwardGraphs(True)  # asked for: the error is raised
    target_graph._FAILED.pop(ft.model)
    ft.capture(batch, [0], padded=False)
    with pytest.raises(RuntimeError, match="capturing"):
        ft.capture(batch, [0], padded=False)


def test_batches_that_cannot_be_captured_run_eagerly(graphs):
    model, tok = tiny_text_target()
    ft = FrozenTarget(model)
    ft.forward_graphs = graphs
    batch = {**_batch(tok, 2, 0), "note": ["a list"]}  # not hashable: no signature
    for _ in range(3):
        ft.capture(batch, [0], padded=False)
    assert StandIn.made == [] and not graphs.sightings


def test_which_targets_can_be_captured():
    model, tok = tiny_text_target()
    text = FrozenTarget(model)
    assert graph_blocker(text, CUDA) is None and graph_blocker(text, CPU) == "training runs on cpu, not a GPU"
    assert graph_blocker(FrozenTarget(tiny_whisper()[0]), CUDA) is None
    eager = FrozenTarget(tiny_text_target()[0])
    eager.decoder.config._attn_implementation = "eager"
    assert "builds its own mask" in graph_blocker(eager, CUDA)
    assert forward_graphs(None, text, CPU) is None and forward_graphs(False, text, CUDA) is None
    assert isinstance(forward_graphs(None, text, CUDA), TargetForwardGraphs)
    with pytest.raises(ValueError, match="target_cuda_graph=True: training runs on cpu"):
        forward_graphs(True, text, CPU)


def test_an_audio_llm_family_is_not_captured(asr_target):
    assert "reads values back to the host" in graph_blocker(FrozenTarget(asr_target), CUDA)


@pytest.fixture
def asr_target():
    from dflash_hf import tiny

    return tiny.build_qwen3_asr_target()[0]


def test_the_trainer_refuses_target_cuda_graph_on_the_cpu_before_building_the_draft(tmp_path):
    model, tok = tiny_text_target()
    assert make_trainer(tmp_path, model, tok).target.forward_graphs is None  # unset: eager on the CPU
    with pytest.raises(ValueError, match="target_cuda_graph=True: training runs on cpu, not a GPU"):
        make_trainer(tmp_path, model, tok, target_cuda_graph=True)
