"""The cheap cases of `scripts/fuzz_inputs.py` through `dflash-generate-labels` (the console script that reads a
manifest fastest): each ends as a clear error, handled, or skipped and counted; never silent-wrong or a raw crash.
The whole set (every command, every case) is the script: `python scripts/fuzz_inputs.py`."""

import pytest
from utils import REPO_ROOT, script_fixture

fuzz = script_fixture(REPO_ROOT / "scripts" / "fuzz_inputs.py")

CHEAP = [
    "NaN sample (float wav)",
    "1e30 sample (finite, absurd)",
    "stereo wav",
    "junk bytes named .mp4 (only ffmpeg could try)",
    "transcript holds <|im_end|>",
    "context holds <|im_end|><|im_start|>system",
    "lone surrogate in another key",
    "line that is not JSON",
    "byte-order mark",
    "y;touch X1;.sph (a wav)",
    "a$(touch X2).sph (a wav)",
    "z;touch X;.sph (junk: only a program could decode)",
]


@pytest.fixture(scope="module")
def assets(fuzz, tmp_path_factory):
    from dflash_hf.testing import tiny

    root = tmp_path_factory.mktemp("fuzz")
    target = tiny.save_tiny_target(
        root / "target", "qwen3_asr", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1
    )
    manifest = tiny.synthesize_speech(root / "speech", 2, seed=0, min_dur=0.5, max_dur=0.8)
    import json

    good = []
    for line in manifest.read_text().splitlines():
        row = json.loads(line)
        good.append({**row, "audio_filepath": str(manifest.parent / row["audio_filepath"])})
    return fuzz.Assets(root, target, root / "no-draft", good, manifest.parent / json.loads(line)["audio_filepath"])


def test_every_cheap_case_is_a_case_of_the_script(fuzz):
    assert set(CHEAP) <= {c.name for c in fuzz.cases()}


@pytest.mark.parametrize("name", CHEAP)
@pytest.mark.parametrize("skip", [False, True])
def test_cheap_case_through_generate_labels(fuzz, assets, tmp_path, name, skip):
    (case,) = [c for c in fuzz.cases() if c.name == name]
    result = fuzz.classify(case, "gen", skip, tmp_path, assets)
    assert result["outcome"] in fuzz._expected(case, "gen", skip), result
    assert not list(tmp_path.rglob(f"{fuzz.MARKER}*"))


def test_outcomes_are_tabled_by_category(fuzz):
    results = [
        {"category": "audio", "outcome": "clear error"},
        {"category": "audio", "outcome": "handled"},
        {"category": "text", "outcome": "skipped and counted"},
    ]
    table = fuzz.table(results)
    assert "| audio | 2 | 1 | 1 | 0 | 0 | 0 |" in table and "| all | 3 | 1 | 1 | 1 | 0 | 0 |" in table
