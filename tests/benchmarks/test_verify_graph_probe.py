"""benchmarks/verify_graph_probe.py on tiny random targets (CPU): the package's fixed-buffer verify equals the growing
cache's, block by block."""

import json

import pytest
from utils import REPO_ROOT, script_fixture

SCRIPT = REPO_ROOT / "benchmarks" / "verify_graph_probe.py"


probe = script_fixture(SCRIPT)


@pytest.mark.parametrize("kind", ["whisper", "text"])
def test_fixed_buffer_verify_matches_the_growing_cache_on_every_block(probe, tmp_path, kind):
    out = tmp_path / "probe.json"
    results = probe.main(
        [
            "--tiny",
            kind,
            "--num_prompts",
            "3",
            "--max_new_tokens",
            "24",
            "--step",
            "3",
            "--device",
            "cpu",
            "--output_json",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    static = results["static_vs_dynamic"]["static"]
    assert results["verifies"] > 3 and static["positions"] == 8 * results["verifies"]
    assert static["argmax_differs"] == 0 and static["max_abs_logit_diff"] < 1e-4  # rounding only
    assert results["median_ms"]["graph"] is None and results["graph_error"] is None  # no CUDA graph on the CPU


def test_anchor_and_block_helpers_and_argument_errors(probe):
    import torch

    assert probe.anchors(4, 15, 4) == [4, 8, 12]
    seq = torch.arange(10)[None]
    assert probe.block_ids(seq, 7, 5).tolist() == [[7, 8, 9, 9, 9]]  # past the end: the last token repeated
    for argv, message in (
        (["--tiny", "text", "--step", "0"], "--step must be in 1..block_size"),
        (["--target", "x"], "--target and --data go together"),
        ([], "give --tiny"),
    ):
        with pytest.raises(SystemExit, match=message):
            probe.main(argv)
