"""`target_cuda_graph`: when the frozen target's training forward is captured, what a replay reads, and how a failed
capture falls back. The CUDA graph itself needs a GPU (tests/gpu/test_gpu.py checks that a replay gives the eager
features bit for bit); on the CPU `CapturedForward` runs the same forward on its fixed input tensors at every replay,
so a replay that read anything but what it copies in (a mask, a layout baked in at capture) would differ here."""

from __future__ import annotations

import logging

import pytest
import torch
from utils import (
    GRAPH_CASES,
    assert_replays_match_eager,
    graph_case,
    make_trainer,
    random_rows,
    text_batch,
    tiny_text_target,
    tiny_whisper,
)

from dflash_hf.targets import forward_graph
from dflash_hf.targets.forward_graph import TargetForwardGraphs, forward_graphs, graph_blocker
from dflash_hf.targets.frozen import FrozenTarget

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


class Counted(forward_graph.CapturedForward):
    made: list = []

    def __init__(self, ft, batch, *args, **kwargs):
        super().__init__(ft, batch, *args, **kwargs)
        Counted.made.append(tuple(batch["input_ids"].shape))


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr(forward_graph, "CapturedForward", Counted)
    Counted.made = []
    return TargetForwardGraphs(None)


@pytest.fixture
def text():
    return tiny_text_target()


def _rows(rows: int, seed: int, lengths=None):
    """Random rows of a 4-token prompt and a response of `lengths[i]` tokens (default 8)."""
    return [
        (p[:4], r[: (lengths or [8] * rows)[i]])
        for i, (p, r) in enumerate(random_rows(rows, 250, seed=seed, resp_len=(17, 20)))
    ]


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
@pytest.mark.slow  # 12 s on 2 busy cores
def test_replays_read_only_their_fixed_inputs(graphs, case):
    model, batches = graph_case(case)
    ft = FrozenTarget(model)
    ft.forward_graphs = graphs
    assert_replays_match_eager(ft, batches, GRAPH_CASES[case])
    assert len(Counted.made) == 1 and graphs.replays == 2  # captured at the second sighting, replayed twice


def test_the_key_holds_what_the_target_reads(graphs, text):
    model, tok = text
    ft = FrozenTarget(model)
    ft.forward_graphs = graphs
    batch = text_batch(_rows(2, 0), tok.pad_token_id)
    other_loss = {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}  # the draft's side: the same key
    for b in (batch, other_loss):
        ft.capture(b, [0], padded=False)
    assert len(Counted.made) == 1 and "loss_mask" not in next(iter(graphs.graphs.values())).inputs
    ft.capture(batch, [1], padded=False)  # other taps: another signature
    ft.capture(batch, [0], keep_final=True, padded=False)  # final states kept: another
    assert len(Counted.made) == 1 and graphs.replays == 1


@pytest.mark.slow  # 16 s on 2 busy cores
def test_each_signature_is_captured_once_and_at_most_max_graphs_are_kept(graphs, text, monkeypatch):
    monkeypatch.setattr(forward_graph, "MAX_GRAPHS", 2)
    model, tok = text
    ft = FrozenTarget(model)
    ft.forward_graphs = graphs
    batches = [text_batch(_rows(n, n), tok.pad_token_id) for n in (1, 2, 3)]
    for _ in range(5):  # three shapes cycling through room for two: no recapture once one was dropped
        for batch in batches:
            ft.capture(batch, [0], padded=False)
    assert Counted.made == [(1, 12), (2, 12), (3, 12)] and len(graphs.graphs) == 2
    assert len(graphs.dropped) == 1


def test_kept_graphs_stay_within_max_kept_bytes(graphs, text, monkeypatch):
    model, tok = text
    ft = FrozenTarget(model)
    ft.forward_graphs = graphs
    batches = [text_batch(_rows(n, n), tok.pad_token_id) for n in (1, 2)]
    for batch in batches * 2:
        ft.capture(batch, [0], padded=False)
    sizes = [g.nbytes for g in graphs.graphs.values()]
    assert len(sizes) == 2 and all(sizes)
    monkeypatch.setattr(forward_graph, "MAX_KEPT_BYTES", sizes[1])  # room for the larger one alone
    batch = text_batch(_rows(3, 3), tok.pad_token_id)
    for _ in range(2):
        ft.capture(batch, [0], padded=False)
    assert [k[0][0][1][0] for k in graphs.graphs] == [3]  # the newest only (input_ids rows)


@pytest.mark.parametrize(
    "error",
    [RuntimeError("operation not permitted when stream is capturing"), torch.OutOfMemoryError("CUDA out of memory")],
)
def test_a_failed_capture_stops_capturing_with_one_warning(graphs, text, monkeypatch, caplog, error):
    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(forward_graph, "CapturedForward", fails)
    model, tok = text
    ft = FrozenTarget(model)
    ft.forward_graphs = graphs
    batches = [text_batch(_rows(n, n), tok.pad_token_id) for n in (1, 2)]
    with caplog.at_level(logging.WARNING, logger="dflash_hf.ops.cuda_graphs"):
        for batch in batches * 3:
            ref = ft.features(batch, [0])
            assert torch.equal(ft.capture(batch, [0], padded=False).taps, ref.taps)
    assert caplog.text.count("could not run") == 1 and "target_cuda_graph=false skips the attempt" in caplog.text
    assert graphs.stopped and (ft.model in forward_graph._FAILED) != isinstance(error, torch.OutOfMemoryError)
    forward_graph._FAILED.pop(ft.model, None)
    ft.forward_graphs = TargetForwardGraphs(True)  # asked for: the error is raised
    ft.capture(batches[0], [0], padded=False)
    with pytest.raises(type(error)):
        ft.capture(batches[0], [0], padded=False)


def test_a_batch_that_cannot_be_captured(graphs, text):
    model, tok = text
    ft = FrozenTarget(model)
    ft.forward_graphs = graphs
    batch = {**text_batch(_rows(2, 0), tok.pad_token_id), "note": ["a list"]}  # not hashable: no key
    for _ in range(3):
        ft.capture(batch, [0], padded=False)
    assert Counted.made == [] and not graphs.sightings
    ft.forward_graphs = TargetForwardGraphs(True)
    with pytest.raises(ValueError, match="target_cuda_graph=True: this batch cannot be captured: its 'note' is a list"):
        ft.capture(batch, [0], padded=False)


def test_which_targets_can_be_captured(text):
    model, tok = text
    ft = FrozenTarget(model)
    assert graph_blocker(ft, CUDA) is None and graph_blocker(ft, CPU) == "training runs on cpu, not a GPU"
    assert graph_blocker(FrozenTarget(tiny_whisper()[0]), CUDA) is None
    eager = FrozenTarget(tiny_text_target()[0])
    eager.decoder.config._attn_implementation = "eager"
    assert "builds its own mask" in graph_blocker(eager, CUDA)
    assert forward_graphs(None, ft, CPU) is None and forward_graphs(False, ft, CUDA) is None
    assert isinstance(forward_graphs(None, ft, CUDA), TargetForwardGraphs)
    with pytest.raises(ValueError, match="target_cuda_graph=True: training runs on cpu"):
        forward_graphs(True, ft, CPU)


def test_an_audio_llm_family_is_not_captured():
    from dflash_hf.testing import tiny

    asr = FrozenTarget(tiny.build_qwen3_asr_target()[0])
    assert "reads values back to the host" in graph_blocker(asr, CUDA)


def test_the_trainer_refuses_target_cuda_graph_on_the_cpu(tmp_path, text):
    model, tok = text
    assert make_trainer(tmp_path, model, tok).target.forward_graphs is None  # unset: eager on the CPU
    with pytest.raises(ValueError, match="target_cuda_graph=True: training runs on cpu, not a GPU"):
        make_trainer(tmp_path, model, tok, target_cuda_graph=True)


def test_a_target_sharded_by_fsdp2_is_not_captured(text):
    from dflash_hf.training.distributed import shard_frozen_target_layers

    ft = FrozenTarget(text[0])
    ft.forward_graphs = TargetForwardGraphs(True)
    with pytest.raises(ValueError, match="target_cuda_graph=True: the frozen target's layers are sharded"):
        shard_frozen_target_layers(ft)
    ft.forward_graphs = TargetForwardGraphs(None)  # the default: dropped (here before the missing process group)
    with pytest.raises(RuntimeError, match="initialized process group"):
        shard_frozen_target_layers(ft)
    assert ft.forward_graphs is None
