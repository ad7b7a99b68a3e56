"""Publishing: the exact folder `push_draft_to_hub` uploads, its model card, and no network (HfApi mocked)."""

from __future__ import annotations

import os
from pathlib import Path

import huggingface_hub
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModel
from utils import tiny_draft_config

from dflash_hf import DFlash2DraftModel
from dflash_hf.export.hub import DraftCardInfo, push_draft_to_hub

UPLOAD = [
    "README.md",
    "config.json",
    "configuration_dflash.py",
    "draft_fields.py",
    "model.safetensors",
    "modeling_dflash.py",
    "modeling_dflash_encoder.py",
]
REPO = "someone/tiny-asr-dflash2-b16"


@pytest.fixture
def export(tmp_path) -> Path:
    torch.manual_seed(0)
    config = tiny_draft_config(
        {
            "mask_token_id": 7,
            "target_layer_ids": [1, 3],
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 8,
            "selector_top_k": 4,
        },
        block_size=16,
        num_target_layers=6,
        architectures=["DFlash2DraftModel"],
        hidden_size=32,
        head_dim=8,
        vocab_size=50,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    out = tmp_path / "export"
    DFlash2DraftModel(config).save_pretrained(out)
    # leftovers a training run may leave next to the export: never uploaded
    save_file({"mask_embedding": torch.zeros(32)}, str(out / "mask_embedding.safetensors"))
    (out / "training_args.bin").write_bytes(b"\0")
    return out


CARD = DraftCardInfo(
    target_id="org/tiny-asr",
    target_revision="abc1234",
    data_summary="100 h of synthetic read speech, target_argmax labels.",
    tau_est=4.25,
    tau=3.875,
    eval_name="synthetic-dev",
    license="apache-2.0",
    target_architecture="Qwen3ForCausalLM",  # a text target: a measured serving row, so the card has the command
)


def test_dry_run_folder_and_card(export, tmp_path):
    folder = Path(push_draft_to_hub(export, REPO, card_info=CARD, dry_run_dir=tmp_path / "upload"))
    assert sorted(os.listdir(folder)) == UPLOAD
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert {"fc.weight", "candidate_selector.successor_codebook", "layers.1.mlp_conv.base_kernel"} <= names

    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\nbase_model: org/tiny-asr\nlicense: apache-2.0\n")
    for expected in (
        "| target | `org/tiny-asr` (revision `abc1234`) |",
        "| block size | 16 |",
        "| mask token id | 7 |",
        "| target layer taps | [1, 3] of 6 decoder layers |",
        "DFlash2 (`DFlash2DraftModel`)",
        "| path selector (rank, top-k) | 8, 4 |",
        "100 h of synthetic read speech, target_argmax labels.",
        "| metric (synthetic-dev) | value |",
        "| 4.250 |",
        "| 3.875 |",
        f'"method": "dflash", "model": "{REPO}", "num_speculative_tokens": 15',
        "vLLM 0.34 serves this draft with its text target",
        f'draft = DFlash2DraftModel.from_pretrained("{REPO}")',
        'AutoModelForCausalLM.from_pretrained("org/tiny-asr", revision="abc1234")',
        "speculative_generate(draft, target, max_new_tokens=256, **inputs)",
    ):
        assert expected in card, expected
    assert "sglang" not in card.lower()  # no engine without a measured row

    # serving needs nothing new: the uploaded folder loads as remote code
    remote = AutoModel.from_pretrained(folder, trust_remote_code=True)
    assert type(remote).__name__ == "DFlash2DraftModel" and remote.config.block_size == 16


def test_push_uploads_the_same_folder_without_network(export, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls = []

    class FakeCommit:
        commit_url = f"https://huggingface.co/{REPO}/commit/0"

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))

        def upload_folder(self, *, repo_id, folder_path, **kwargs):
            files = sorted(os.listdir(folder_path))
            calls.append(("upload_folder", repo_id, files, Path(folder_path, "README.md").read_text(), kwargs))
            return FakeCommit()

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    url = push_draft_to_hub(export, REPO, card_info=CARD, private=True, token="tok")
    assert url == FakeCommit.commit_url
    assert [c[0] for c in calls] == ["init", "create_repo", "upload_folder"]
    assert calls[0][1] == "tok"
    assert calls[1][1] == REPO and calls[1][2]["private"] is True and calls[1][2]["exist_ok"] is True
    _, repo, files, readme, kwargs = calls[2]
    assert repo == REPO and files == UPLOAD and kwargs["repo_type"] == "model"
    dry = Path(push_draft_to_hub(export, REPO, card_info=CARD, dry_run_dir=tmp_path / "dry"))
    assert readme == (dry / "README.md").read_text()


def test_push_errors_before_upload(export, tmp_path):
    with pytest.raises(ValueError, match=r"card_info.tau=20.0 is outside \[1, block_size=16\]"):
        push_draft_to_hub(export, REPO, card_info=DraftCardInfo("org/t", tau=20.0), dry_run_dir=tmp_path / "a")
    with pytest.raises(ValueError, match="target_id"):
        push_draft_to_hub(export, REPO, card_info=DraftCardInfo(target_id=""), dry_run_dir=tmp_path / "b")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="dry_run_dir"):
        push_draft_to_hub(export, REPO, card_info=CARD, dry_run_dir=tmp_path / "full")
    with pytest.raises(huggingface_hub.errors.HFValidationError):
        push_draft_to_hub(export, "not a repo id", card_info=CARD, dry_run_dir=tmp_path / "c")
    (export / "modeling_dflash.py").unlink()
    with pytest.raises(FileNotFoundError, match="modeling_dflash.py"):
        push_draft_to_hub(export, REPO, card_info=CARD, dry_run_dir=tmp_path / "d")
