"""The training record of a draft export, `dflash_training.json`: what the training run used that evaluating the draft
repeats, kept beside the model config rather than in it.

- `num_anchors`: the anchors per row the run trained with (`--validate_only` of the export evaluates with them);
- `conversation`: the conversation settings its training rendered (user prompt, system prompt, cut fields, family
  row), so that `dflash-eval` renders its prompts as training did (`checked_conversation`).

Exports written before the record had these two entries inside `config.json`'s `dflash_config`; `read_training_record`
still finds them there, and `LEGACY_KEYS` names them so that loading such an export drops them from the config.
`read_json_object` reads an export's JSON file (the loader in `drafts` uses it too).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

TRAINING_RECORD_FILE = "dflash_training.json"
LEGACY_KEYS = ("num_anchors", "conversation")  # the record's entries, in `dflash_config` of older exports
CONVERSATION_FIELDS = ("prompt", "system_prompt", "context_key", "system_prompt_key", "family")


@dataclass
class TrainingRecord:
    """What an export records of its training run; a field the run did not record is None."""

    num_anchors: int | None = None
    conversation: dict | None = None  # `conversation_record(...)`

    def __bool__(self) -> bool:
        return any(value is not None for value in asdict(self).values())

    def write(self, directory: str | Path) -> None:
        """Write the record into `directory` (an export's staging directory: the export is moved into place whole)."""
        text = json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"
        (Path(directory) / TRAINING_RECORD_FILE).write_text(text)


def conversation_record(conversation, family: str) -> dict:
    """The record of the conversation a training run rendered: `conversation` a `ConversationConfig`, `family` the
    target family row's name."""
    return {
        "prompt": conversation.prompt,
        "system_prompt": conversation.system_prompt,
        "context_key": conversation.context_key,
        "system_prompt_key": conversation.system_prompt_key,
        "family": family,
    }


def checked_conversation(record) -> dict | None:
    """The recorded conversation (None for an export without one: trained on rows collated by the caller, or exported
    before it was recorded); a malformed entry is an error naming the field."""
    if record is None:
        return None
    if not isinstance(record, Mapping) or set(record) != set(CONVERSATION_FIELDS):
        raise ValueError(
            f"the draft's training record has a malformed conversation {record!r}: it must map exactly "
            f"{list(CONVERSATION_FIELDS)} (as dflash-train writes it); fix or remove the entry"
        )
    bad = [k for k in CONVERSATION_FIELDS if record[k] is not None and not isinstance(record[k], str)]
    if bad:
        raise ValueError(f"the training record's conversation fields {bad} must be strings or null, got {record!r}")
    return dict(record)


def read_json_object(file: Path) -> dict:
    """A JSON object from `file`; invalid JSON is an error naming the file and line."""
    try:
        raw = json.loads(file.read_text())
    except UnicodeDecodeError as err:
        raise ValueError(f"{file} is not UTF-8 text ({err}); it is not a DFlash draft export's JSON") from err
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{file} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); restore or re-export it"
        ) from err
    if not isinstance(raw, dict):
        raise ValueError(f"{file} holds a JSON {type(raw).__name__}, not an object; restore or re-export it")
    return raw


def read_training_record(directory: str | Path, config_json: dict | None = None) -> TrainingRecord:
    """The training record of the export in `directory`: its `dflash_training.json`, else (an older export) the
    entries its config.json kept in `dflash_config`; an empty record when it has neither. The conversation is checked
    (`checked_conversation`). `config_json`: the export's config.json when the caller has read it already."""
    directory = Path(directory)
    path = directory / TRAINING_RECORD_FILE
    if path.is_file():
        raw = read_json_object(path)
        unknown = sorted(set(raw) - set(LEGACY_KEYS))
        if unknown:
            raise ValueError(f"{path} has unknown entries {unknown}; it holds only {list(LEGACY_KEYS)}")
    else:
        if config_json is None:
            config = directory / "config.json"
            config_json = read_json_object(config) if config.is_file() else {}
        raw = config_json.get("dflash_config") or {}
    num_anchors = raw.get("num_anchors")
    if num_anchors is not None and (isinstance(num_anchors, bool) or not isinstance(num_anchors, int)):
        raise ValueError(f"the training record of {directory} has num_anchors {num_anchors!r}: it must be an integer")
    return TrainingRecord(num_anchors=num_anchors, conversation=checked_conversation(raw.get("conversation")))


__all__ = [
    "CONVERSATION_FIELDS",
    "LEGACY_KEYS",
    "TRAINING_RECORD_FILE",
    "TrainingRecord",
    "checked_conversation",
    "conversation_record",
    "read_json_object",
    "read_training_record",
]
