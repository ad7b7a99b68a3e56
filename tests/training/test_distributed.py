"""DDP on CPU (torchrun, gloo) against one process over the same global batch (docs/ARCHITECTURE.md).

One `torchrun --nproc_per_node 2` launch trains three cases (tests/dist_train.py); the references train in this
process. Every valid anchor is taken (num_anchors > valid anchors), so the blocks do not depend on the split and
the runs must agree up to float32 reduction order: logged losses within 1e-5 relative, final weights within
1e-5 absolute (3 AdamW steps at lr 1e-3 move weights by ~3e-3).
"""

from __future__ import annotations

import sys

import pytest
import torch
from dist_train import MAX_STEPS, train_case
from utils import TESTS_DIR, run_torchrun

pytestmark = pytest.mark.slow  # one torchrun launch shared by the module: 14-20 s on 2 cores
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-5
TIMEOUT_S = 240  # a hung collective (a rank without anchors skipping the all-reduce) fails here


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(TESTS_DIR / "dist_train.py"),
        str(out),
        "ddp_b2:2:1:all",  # 2 ranks x batch 2
        "ddp_ga2:1:2:all",  # 2 ranks x batch 1 x 2 accumulation steps
        "ddp_empty:1:1:half_empty",  # 2 ranks x batch 1; rank with the empty row has no valid anchor
        "ddp_auto:2:1:all:auto",  # as ddp_b2 without use_cpu: no CUDA, so DDP on CPU (not 2 separate runs)
        "fsdp_target",  # FSDP2-sharded frozen target vs an unsharded copy
        "fsdp_encoder_draft",  # FSDP2-sharded encoder-context draft vs an unsharded copy
        "budget",  # max_train_minutes crossed on rank 0 only
        "row_preflight",  # the manifest's rows read by rank 0 only
    ]
    run_torchrun(cmd, TIMEOUT_S)
    return {p.stem: torch.load(p) for p in out.glob("*.pt")}


def _assert_same_run(got: dict, ref: dict) -> None:
    assert len(got["losses"]) == len(ref["losses"]) == MAX_STEPS
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)
    assert got["weights"].keys() == ref["weights"].keys()
    for name, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=WEIGHT_ATOL, msg=name)


def test_ddp_batch_split_and_grad_accumulation_match_one_process(tmp_path, ddp_runs):
    ref = train_case(str(tmp_path), "ref", per_device_batch=4, grad_accum=1, rows="all")
    ga = train_case(str(tmp_path), "ga4", per_device_batch=1, grad_accum=4, rows="all")
    assert ref["losses"][0] > ref["losses"][-1]  # it trains
    _assert_same_run(ga, ref)  # 1 process: 4 micro-batches of 1 == 1 batch of 4
    _assert_same_run(ddp_runs["ddp_b2"], ref)  # 2 ranks x 2
    _assert_same_run(ddp_runs["ddp_ga2"], ref)  # 2 ranks x 1 x 2 accumulation steps
    _assert_same_run(ddp_runs["ddp_auto"], ref)  # torchrun without --use_cpu on a machine without CUDA


def test_rank_without_valid_anchor_joins_and_matches_one_process(tmp_path, ddp_runs):
    ref = train_case(str(tmp_path), "ref_empty", per_device_batch=2, grad_accum=1, rows="half_empty")
    assert all(loss > 0 for loss in ref["losses"])
    _assert_same_run(ddp_runs["ddp_empty"], ref)


def test_fsdp2_sharded_target_gives_the_same_taps(ddp_runs):
    for rank in (0, 1):
        r = ddp_runs[f"fsdp_target_rank{rank}"]
        assert r["sharded_layers"] == 4
        assert r["local_rows"] * 2 == r["full_rows"]  # each rank holds half of every layer weight
        assert r["taps_max_abs"] == 0.0 and r["final_max_abs"] == 0.0


def test_fsdp2_sharded_encoder_context_draft_matches_the_unsharded_one(ddp_runs):
    for rank in (0, 1):  # failed with "mixed torch.Tensor and DTensor" when the frames' keys were computed outside
        r = ddp_runs[f"fsdp_encoder_draft_rank{rank}"]
        assert r["hidden_max_abs"] < 1e-6 and r["k_grad_max_abs"] < 1e-6, r


def test_the_data_pre_flight_reads_the_rows_once_per_process_group(ddp_runs):
    assert ddp_runs["preflight_rank0"] == {"scans": 1, "skipped": 1}
    assert ddp_runs["preflight_rank1"] == {"scans": 0, "skipped": 1}  # rank 0's result, counted by rank 1's loader


def test_ranks_stop_at_the_same_step_when_one_crosses_its_time_budget(ddp_runs):
    for rank in (0, 1):  # the verdict of step 1 (rank 0 over) is read at step 2 by both ranks
        assert ddp_runs[f"budget_rank{rank}"] == {"stopped": [False, True, True, True], "save": True}
