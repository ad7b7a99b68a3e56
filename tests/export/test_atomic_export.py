"""Exports are atomic and finite: a process killed while exporting over an older export never leaves new files
beside old weights that load; a draft with non-finite weights is never exported, and loading one is an error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from utils import tiny_draft_config

from dflash_hf import DFlashDraftModel
from dflash_hf.export import drafts
from dflash_hf.export.drafts import export_draft, load_draft_strict

REPO_ROOT = Path(__file__).resolve().parents[2]


def _draft(seed: int, block_size: int = 8) -> DFlashDraftModel:
    torch.manual_seed(seed)
    config = tiny_draft_config(
        {"mask_token_id": 5, "target_layer_ids": [1, 2]},
        block_size=block_size,
        num_target_layers=4,
        hidden_size=32,
        head_dim=8,
        vocab_size=40,
    )
    return DFlashDraftModel(config)


def _same_weights(model: torch.nn.Module, other: torch.nn.Module) -> bool:
    a, b = model.state_dict(), other.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_write_failing_midway_keeps_the_older_export_whole(tmp_path, monkeypatch):
    old = _draft(0, block_size=8)
    out = export_draft(old, tmp_path / "draft")
    new = _draft(1, block_size=4)  # same shapes: the old weights would load under the new config

    def config_then_crash(self, directory, **kwargs):
        self.config.save_pretrained(directory)  # the new config.json is written ...
        raise OSError("killed while writing the weights")  # ... and the weights never are

    monkeypatch.setattr(DFlashDraftModel, "save_pretrained", config_then_crash)
    with pytest.raises(OSError, match="killed while writing"):
        export_draft(new, out)
    monkeypatch.undo()
    loaded = load_draft_strict(out)
    assert loaded.config.block_size == 8 and _same_weights(loaded, old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]  # the staging directory is gone


def test_export_replaces_an_older_export_and_leaves_no_staging(tmp_path):
    export_draft(_draft(0), tmp_path / "draft")
    (tmp_path / "draft" / "notes.txt").write_text("of the older export")
    new = _draft(1, block_size=4)
    seen = []

    def record(directory: Path) -> None:  # written inside the new export before it is moved into place
        seen.append(directory.name)
        (directory / "run.json").write_text("{}")

    export_draft(new, tmp_path / "draft", write_extra=record)
    loaded = load_draft_strict(tmp_path / "draft")
    assert loaded.config.block_size == 4 and _same_weights(loaded, new)
    assert not (tmp_path / "draft" / "notes.txt").exists() and (tmp_path / "draft" / "run.json").is_file()
    assert seen[0].startswith(".draft.partial-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


_KILLED_EXPORT = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])
    import torch
    from utils import tiny_draft_config
    from dflash_hf import DFlashDraftModel
    from dflash_hf.export.drafts import export_draft

    torch.manual_seed(1)
    config = tiny_draft_config({"mask_token_id": 5, "target_layer_ids": [1, 2]}, block_size=4, num_target_layers=4,
                               hidden_size=32, head_dim=8, vocab_size=40)
    draft = DFlashDraftModel(config)
    phase = sys.argv[2]
    if phase == "weights":  # SIGKILL once the new config.json is written, before any weight is
        original = DFlashDraftModel.save_pretrained
        def save(self, directory, **kw):
            self.config.save_pretrained(directory)
            os.kill(os.getpid(), signal.SIGKILL)
        DFlashDraftModel.save_pretrained = save
    else:  # SIGKILL between moving the older export aside and moving the new one in
        real_rename = os.rename
        def rename(src, dst):
            real_rename(src, dst)
            if ".previous-" in str(dst):
                os.kill(os.getpid(), signal.SIGKILL)
        os.rename = rename
    export_draft(draft, Path(sys.argv[1]))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["weights", "rename"])
def test_sigkill_while_exporting_never_passes_for_a_finished_export(tmp_path, phase):
    old = _draft(0, block_size=8)
    out = export_draft(old, tmp_path / "draft")
    script = tmp_path / "kill.py"
    script.write_text(_KILLED_EXPORT)
    tests_dir = str(REPO_ROOT / "tests")
    proc = subprocess.run([sys.executable, str(script), str(out), phase, tests_dir], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    if phase == "weights":  # the older export is untouched
        loaded = load_draft_strict(out)
        assert loaded.config.block_size == 8 and _same_weights(loaded, old)
    else:  # no export under that name; the error says where the older, complete one is
        with pytest.raises(FileNotFoundError, match=r"interrupted .* the older, complete export is at .*previous"):
            load_draft_strict(out)
    # the next export cleans up after the killed one
    new = _draft(2, block_size=4)
    export_draft(new, out)
    assert _same_weights(load_draft_strict(out), new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "kill.py"]


def test_a_live_exports_staging_directory_is_left_alone(tmp_path):
    export_draft(_draft(0), tmp_path / "draft")
    live = tmp_path / f".draft.partial-{os.getpid()}-0123abcd"
    dead = tmp_path / ".draft.partial-999999999-0123abcd"
    live.mkdir()
    dead.mkdir()
    export_draft(_draft(1), tmp_path / "draft")
    assert live.is_dir() and not dead.exists()


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "qwen2"})), "config.json is not a DFlash"),
        (lambda d: (d / "checkpoint-10").mkdir(), "it holds checkpoint-10"),
        (lambda d: (d / "optimizer.pt").write_bytes(b"x"), "it holds optimizer.pt"),
    ],
)
def test_a_directory_that_is_not_a_draft_export_is_never_replaced(tmp_path, setup, match):
    target = tmp_path / "dir"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    setup(target)
    before = sorted(p.name for p in target.iterdir())
    with pytest.raises(FileExistsError, match=match):
        export_draft(_draft(0), target)
    assert sorted(p.name for p in target.iterdir()) == before


def test_a_draft_with_non_finite_weights_is_never_exported(tmp_path):
    draft = _draft(0)
    with torch.no_grad():
        draft.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
        draft.fc.weight[1, 1] = float("inf")
    with pytest.raises(ValueError, match=r"non-finite weights .* 2 tensors: fc.weight, layers.0.mlp.up_proj.weight"):
        export_draft(draft, tmp_path / "draft")
    assert not (tmp_path / "draft").exists()


def test_loading_an_export_with_non_finite_weights_says_so(tmp_path):
    out = export_draft(_draft(0), tmp_path / "draft")
    state = load_file(str(out / "model.safetensors"))
    state["norm.weight"][0] = float("nan")
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"non-finite weights \(NaN or inf\) in 1 tensor: norm.weight"):
        load_draft_strict(out)


def test_staging_siblings_match_only_this_exports_name(tmp_path):
    (tmp_path / ".draft[1].partial-1-ab").mkdir()
    (tmp_path / ".draft1.partial-1-ab").mkdir()
    assert [p.name for p in drafts.staging_siblings(tmp_path / "draft[1]", "partial")] == [".draft[1].partial-1-ab"]


def test_export_into_the_current_directory_is_refused(tmp_path, monkeypatch):
    export_draft(_draft(0), tmp_path / "draft")
    monkeypatch.chdir(tmp_path / "draft")
    for given in (".", str(tmp_path / "draft")):
        with pytest.raises(ValueError, match="is the current directory"):
            export_draft(_draft(1), given)
    assert load_draft_strict(tmp_path / "draft").config.block_size == 8
