"""benchmarks/data_loader.py: the sampler alone and the whole loader see the same batches, epoch by epoch, and
the results name what was measured (the timings themselves are a benchmark's business, not a test's)."""

import json

from utils import REPO_ROOT, script_fixture

from dflash_hf.testing import tiny

bench = script_fixture(REPO_ROOT / "benchmarks" / "data_loader.py")


def test_sampler_and_loaders_batch_alike_over_epochs(tmp_path, bench):
    target = tiny.save_tiny_target(tmp_path / "target", "qwen3_asr", hidden_size=32, num_layers=2)
    manifest = tiny.synthesize_speech(tmp_path / "speech", 6, min_dur=0.6, max_dur=1.2)
    out = tmp_path / "loader.json"
    result = bench.main(
        [
            "--target",
            str(target),
            "--data",
            str(manifest),
            "--max-tokens",
            "200",
            "--workers",
            "0",
            "1",
            "--epochs",
            "2",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == result
    rows = result["rows"]
    draw = rows.pop("anchor_draw")
    assert draw["batches"] == 3 and draw["num_anchors"] == 64 and draw["ms_per_batch"] > 0  # 3 batches an epoch
    assert set(rows) == {"sampler", "loader_workers_0", "loader_workers_1"}
    shapes = {
        name: [(e["epoch"], e["batches"], e["rows_per_batch"]) for e in row["epochs"]] for name, row in rows.items()
    }
    assert shapes["sampler"] == shapes["loader_workers_0"] == shapes["loader_workers_1"]
    assert [e[0] for e in shapes["sampler"]] == [0, 1] and sum(e[1] * e[2] for e in shapes["sampler"]) == 12
    assert all(e["ms_per_batch"] > 0 for row in rows.values() for e in row["epochs"])


def test_whisper_waves_and_compact_features_batch_alike_and_report_their_bytes(tmp_path, bench):
    target = tiny.save_tiny_target(tmp_path / "target", "whisper")
    manifest = tiny.synthesize_speech(tmp_path / "speech", 6, min_dur=0.6, max_dur=1.2)
    results = {
        features: bench.main(
            [
                "--target",
                str(target),
                "--data",
                str(manifest),
                "--max-tokens",
                "200",
                "--workers",
                "0",
                "--epochs",
                "1",
                "--features",
                features,
            ]
        )
        for features in ("waves", "compact")
    }
    loaders = {f: r["rows"]["loader_workers_0"]["epochs"][0] for f, r in results.items()}
    assert results["waves"]["features"] == "waves" and results["compact"]["features"] == "compact"
    assert loaders["waves"]["rows_per_batch"] == loaders["compact"]["rows_per_batch"] > 0
    # 16 kHz samples against the tiny target's mel values at 100 frames a second: more bytes than the features
    assert loaders["waves"]["mib_per_batch"] > loaders["compact"]["mib_per_batch"] > 0
    assert "mib_per_batch" not in results["waves"]["rows"]["sampler"]["epochs"][0]  # the sampler yields cuts
