"""benchmarks/decode_ops.py: operators and host reads per speculative cycle and per greedy step (tiny targets)."""

import json

import pytest
from utils import REPO_ROOT, script_fixture

SCRIPT = REPO_ROOT / "benchmarks" / "decode_ops.py"


ops = script_fixture(SCRIPT)


@pytest.fixture(scope="module")
def whisper_counts(ops, tmp_path_factory):
    out = tmp_path_factory.mktemp("ops") / "ops.json"
    results = ops.main(["--tiny", "whisper", "--num_prompts", "1", "--max_new_tokens", "6", "--output_json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    return results


def test_counts_add_up_and_outputs_are_identical(whisper_counts):
    results = whisper_counts
    greedy = results["greedy_step"]
    assert greedy["iterations"] == 5  # 6 new tokens: the prefill step, then 5 steps
    per = greedy["per_iteration"]
    assert per["ops"]["forward"] > 0 and per["reads"]["total"] >= 1  # generate reads its stop flag every step
    assert sum(per["ops"][p] for p in ("forward", "scores", "stop", "other")) == pytest.approx(per["ops"]["total"])
    for variant in ("dflash", "dflash2"):
        spec = results["speculative"][variant]
        assert spec["outputs_identical"] and spec["draft"]["encoder_context"]
        assert spec["iterations"] > 0 and spec["tokens"] == 5  # the first token comes from the prefill
        per = spec["per_iteration"]
        phases = ("draft", "proposal", "verify", "scores", "accept", "stop", "crop", "other")
        assert sum(per["ops"][p] for p in phases) == pytest.approx(per["ops"]["total"])
        assert per["ops"]["draft"] > 0 and per["ops"]["verify"] > 0 and per["ops"]["proposal"] > 0
        lo, hi = spec["ops_per_iteration_min_max"]
        assert 0 < lo <= per["ops"]["total"] <= hi
        assert spec["per_prompt"]["prefill"]["ops"] > 0 and spec["per_prompt"]["setup"]["ops"] > 0


def test_counter_classifies_operators(ops):
    import torch

    counter = ops.OpCounter(starts="draft", ends="decode", phases=("draft", "other"))
    x = torch.randn(4, 6)
    with ops.counting(counter):
        with counter.measure("draft"):  # starts loop iteration 1
            y = x.t().reshape(-1)  # a view, then a copy (not a view: transposed)
            x[x > 0]  # boolean indexing: a nonzero, a host read
            x[torch.tensor([0, 2])]  # integer indexing: a gather; torch.tensor: a host tensor
            int(x.sum())  # a sum and a host read
            y.tolist()  # a host read
    per = counter.summary()["per_iteration"]
    assert per["reads"]["draft"] == 3 and per["host_tensors"]["draft"] == 1
    assert per["ops"]["draft"] >= 3  # the copy, the gather, the sum (the boolean indexing may add its own ops)
    assert torch.Tensor.tolist.__qualname__ == "Tensor.tolist" or not hasattr(torch.Tensor.tolist, "__wrapped__")


def test_bad_arguments_are_named(ops):
    with pytest.raises(ValueError, match="give --target"):
        ops.main([])
    with pytest.raises(ValueError, match="--tiny must be one of"):
        ops.main(["--tiny", "qwen"])
    with pytest.raises(ValueError, match="--target needs --data"):
        ops.main(["--target", "x"])


def test_a_cycle_stays_within_its_operator_bounds(whisper_counts):
    """Regression bounds on the loop's own work per cycle (deterministic counts): Whisper's suppression is one
    masked_fill, acceptance an argmax and a cat, one host read (the acceptance), no host tensor outside the draft's
    first-cycle cache set-up, and the rest of the loop (block ids, embedding, verify ids, sequence growth) at most
    4 operators a cycle on average, the occasional growth of the positions included."""
    for variant in ("dflash", "dflash2"):
        per = whisper_counts["speculative"][variant]["per_iteration"]
        ops = per["ops"]
        assert ops["scores"] == 1 and ops["accept"] == 2 and ops["crop"] == 0 and ops["stop"] == 0, variant
        assert ops["other"] <= 4, variant
        assert per["reads"]["total"] == 1, variant
        assert all(v == 0 for phase, v in per["host_tensors"].items() if phase not in ("draft", "total")), variant
    assert whisper_counts["speculative"]["dflash"]["per_iteration"]["ops"]["proposal"] == 2  # lm_head and argmax


def test_with_the_fixed_steps_the_loop_outside_them_stays_small(ops, tmp_path):
    """--fixed_steps: the draft step and the verify as fixed-shape steps (each one CUDA graph replay on a GPU); the
    loop around them: Whisper's suppression, the acceptance, at most 2 more operators and one host read a cycle,
    and no host tensor."""
    results = ops.main(
        [
            "--tiny",
            "whisper",
            "--num_prompts",
            "1",
            "--max_new_tokens",
            "6",
            "--fixed_steps",
            "true",
            "--variants",
            "dflash",
            "--output_json",
            str(tmp_path / "ops.json"),
        ]
    )
    assert results["name"] == "tiny-whisper-fixed-steps"
    spec = results["speculative"]["dflash"]
    per = spec["per_iteration"]
    assert spec["outputs_identical"] and per["ops"]["proposal"] == 0  # the proposal is inside the draft step
    assert per["ops"]["scores"] == 1 and per["ops"]["accept"] == 2 and per["ops"]["crop"] == 0
    assert per["ops"]["other"] <= 2 and per["reads"]["total"] == 1
    assert all(v == 0 for phase, v in per["host_tensors"].items() if phase not in ("draft", "verify", "total"))


def test_tree_cycles_are_counted_with_the_operators_outside_the_graphs(ops, tmp_path):
    """--tree_budget: token trees verified instead of the chain; with --fixed_steps the captured forwards' operators
    are counted apart, the rest of a cycle is what a GPU launches outside its CUDA graphs (regression bounds)."""
    args = ["--tiny", "whisper", "--num_prompts", "1", "--max_new_tokens", "6", "--variants", "dflash"]
    results = ops.main(
        [*args, "--fixed_steps", "true", "--tree_budget", "8", "--output_json", str(tmp_path / "t.json")]
    )
    assert results["name"] == "tiny-whisper-fixed-steps-tree8"
    spec = results["speculative"]["dflash"]
    per = spec["per_iteration"]
    assert spec["outputs_identical"] and per["reads"]["total"] == 1
    assert 0 < per["graph_ops"]["total"] < per["ops"]["total"]
    assert per["graph_ops"]["accept"] == per["graph_ops"]["scores"] == 0  # both run outside the graphs
    assert per["outside_graphs"]["total"] == pytest.approx(per["ops"]["total"] - per["graph_ops"]["total"])
    # the random draft's trees are accepted on their chain here: the chain's acceptance (argmax, one concatenation),
    # no gather of the path's rows, the verify's two (its inputs as the draft step made them, the root's row) and the
    # sequence's growth
    outside = per["outside_graphs"]
    assert outside["accept"] == 2 and outside["crop"] == 0 and outside["other"] == 1 and outside["verify"] == 2
    with pytest.raises(ValueError, match="tree_budget must be >= 1"):
        ops.main([*args, "--tree_budget", "0"])
