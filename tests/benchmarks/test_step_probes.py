"""benchmarks/label_pass.py and benchmarks/whisper_log_mel.py on the CPU: what they compare holds there."""

from __future__ import annotations

import torch
from utils import REPO_ROOT, loaded_script


def test_label_pass_labels_do_not_depend_on_the_chunk_size_on_the_cpu():
    with loaded_script(REPO_ROOT / "benchmarks" / "label_pass.py") as script:
        report = script.main(["--device", "cpu", "--shape", "tiny", "--chunks", "7", "128", "4096", "--reps", "1"])
    (shape,) = report["shapes"]
    assert shape["positions"] == 4 * (64 - 64 // 8)
    assert [r["chunk"] for r in shape["results"]] == [7, 128, 4096]
    assert all(r["labels_differing"] == 0 for r in shape["results"])


def test_whisper_widths_rounded_up_give_the_same_features_on_the_frames_both_compute():
    with loaded_script(REPO_ROOT / "benchmarks" / "whisper_log_mel.py") as script:
        torch.manual_seed(0)
        wave = torch.randn(3, 5 * 16000 + 360) * 0.1
        wider = script.rounded(wave, 16)
        assert wider.shape[-1] > wave.shape[-1] and torch.equal(wider[:, : wave.shape[-1]], wave)
        assert script.rounded(wider, 16).shape == wider.shape  # already a multiple: unchanged
        report = script.main(["--device", "cpu", "--batches", "2"])
    assert report["rounded_equal_on_kept_frames"] and report["rounded_padding_frames_equal"]
    assert report["cases"]["rounded_16"]["widths"] <= report["cases"]["exact"]["widths"]
