"""The export's training record (`dflash_training.json`): what the training run used that evaluating the draft repeats,
kept out of the model config, still read from older exports that kept it inside `dflash_config`, carried by the
DFlash -> DFlash2 conversion and published with the draft."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from utils import make_args, tiny_draft_config

from dflash_hf import DFlashDraftModel
from dflash_hf.data import ConversationConfig
from dflash_hf.export.conversion import convert_dflash_to_dflash2
from dflash_hf.export.drafts import load_draft_strict
from dflash_hf.export.hub import DraftCardInfo, push_draft_to_hub
from dflash_hf.export.training_record import (
    TRAINING_RECORD_FILE,
    TrainingRecord,
    conversation_record,
    read_training_record,
)

CONVERSATION = {
    "prompt": "Transcribe.",
    "system_prompt": None,
    "context_key": "context",
    "system_prompt_key": "system_prompt",
    "family": "qwen3_asr",
}


def _export(path: Path, **dflash_config) -> Path:
    torch.manual_seed(0)
    config = tiny_draft_config(
        {"mask_token_id": 5, "target_layer_ids": [1, 2], **dflash_config},
        block_size=8,
        num_target_layers=4,
        hidden_size=32,
        head_dim=8,
        vocab_size=48,
    )
    DFlashDraftModel(config).save_pretrained(path)
    return path


def test_the_record_is_written_beside_the_config_and_read_back(tmp_path):
    export = _export(tmp_path / "draft")
    assert not read_training_record(export)  # an export without a record: every entry None
    conversation = conversation_record(ConversationConfig(prompt="Transcribe."), "qwen3_asr")
    TrainingRecord(num_anchors=96, conversation=conversation).write(export)
    record = read_training_record(export)
    assert record == TrainingRecord(num_anchors=96, conversation=CONVERSATION)
    assert "num_anchors" not in json.loads((export / "config.json").read_text())["dflash_config"]
    (export / TRAINING_RECORD_FILE).write_text(json.dumps({"num_anchors": 96, "seed": 3}))
    with pytest.raises(ValueError, match=r"unknown entries \['seed'\]"):
        read_training_record(export)
    (export / TRAINING_RECORD_FILE).write_text(json.dumps({"num_anchors": "many"}))
    with pytest.raises(ValueError, match="num_anchors 'many': it must be an integer"):
        read_training_record(export)


def test_an_older_export_keeps_its_record_in_dflash_config_and_loads_without_it(tmp_path):
    """Exports written before the record held the anchors and the conversation inside `dflash_config`: they are read
    from there, and the loaded draft's config no longer carries them (a re-export writes its own record)."""
    old = _export(tmp_path / "old", num_anchors=96, conversation=CONVERSATION)
    assert read_training_record(old) == TrainingRecord(num_anchors=96, conversation=CONVERSATION)
    draft = load_draft_strict(old)
    assert set(draft.config.dflash_config) == {"block_size", "mask_token_id", "target_layer_ids"}
    args = make_args(tmp_path, init_from_pretrained=str(old), validate_only=True, block_size=None, num_anchors=None)
    args.check_files()  # validate_only repeats the training run's anchors and block size
    assert (args.num_anchors, args.block_size) == (96, 8)


def test_the_conversion_carries_the_record(tmp_path):
    source = _export(tmp_path / "dflash")
    TrainingRecord(num_anchors=48).write(source)
    out = convert_dflash_to_dflash2(source, tmp_path / "dflash2", conv_group_size=8, selector_top_k=4)
    assert read_training_record(out) == TrainingRecord(num_anchors=48)
    legacy = _export(tmp_path / "legacy", conversation=CONVERSATION)  # a record in dflash_config becomes the file
    out = convert_dflash_to_dflash2(legacy, tmp_path / "legacy2", conv_group_size=8, selector_top_k=4)
    assert json.loads((out / TRAINING_RECORD_FILE).read_text())["conversation"] == CONVERSATION
    assert "conversation" not in json.loads((out / "config.json").read_text())["dflash_config"]


def test_the_record_is_published_and_an_export_without_the_draft_fields_file_still_is(tmp_path):
    card = DraftCardInfo(target_id="org/tiny", data_summary="tiny.")
    export = _export(tmp_path / "draft")
    TrainingRecord(num_anchors=96).write(export)
    folder = Path(push_draft_to_hub(export, "someone/tiny", card_info=card, dry_run_dir=tmp_path / "up"))
    assert {TRAINING_RECORD_FILE, "draft_fields.py"} <= set(os.listdir(folder))
    # an export written before draft_fields.py existed: its config module imports no sibling, so none is needed
    old = _export(tmp_path / "old")
    (old / "draft_fields.py").unlink()
    config_code = old / "configuration_dflash.py"
    config_code.write_text(config_code.read_text().replace("from .draft_fields", "from dflash_hf.models.draft_fields"))
    folder = Path(push_draft_to_hub(old, "someone/tiny", card_info=card, dry_run_dir=tmp_path / "up_old"))
    assert "draft_fields.py" not in os.listdir(folder) and "configuration_dflash.py" in os.listdir(folder)


def test_the_warm_start_pre_flight_reads_each_file_of_the_export_once(tmp_path, monkeypatch):
    """`check_files` takes the block size and the recorded anchors from one read of config.json (of an older export,
    the record inside it too) and of the record file."""
    from dflash_hf.export import drafts, training_record

    reads, read = [], training_record.read_json_object

    def counted(file):
        reads.append(file.name)
        return read(file)

    monkeypatch.setattr(drafts, "read_json_object", counted)
    monkeypatch.setattr(training_record, "read_json_object", counted)
    new = _export(tmp_path / "new")
    TrainingRecord(num_anchors=48).write(new)
    old = _export(tmp_path / "old", num_anchors=96)
    for export, files, anchors in ((new, ["config.json", TRAINING_RECORD_FILE], 48), (old, ["config.json"], 96)):
        reads.clear()
        args = make_args(
            tmp_path, init_from_pretrained=str(export), validate_only=True, block_size=None, num_anchors=None
        )
        args.check_files()
        assert (args.num_anchors, args.block_size) == (anchors, 8)
        assert reads == files
