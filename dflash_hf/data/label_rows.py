"""The rows and files of `dflash-generate-labels` (docs/GENERATED_LABELS.md): which manifest rows it labels (its shard,
those an earlier run has not written yet), the line it writes for each (`generated_line`: the target's text, and
`truncated` / `label_ids` where they apply, `dflash_hf.data.generated`) and the output file, written as
``<output>.partial`` (kept by an interrupted run, and resumed from) and renamed over the output once complete.
`dflash_hf.data.label_manifest` runs them."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_hf.data.bad_samples import BadSamples
from dflash_hf.data.conversation import ConversationConfig, ConversationRenderer
from dflash_hf.data.generated import LABEL_IDS_KEY, TRUNCATED_KEY, decoded_response, generated_problem
from dflash_hf.data.json_rows import json_rows, manifest_stem, record_kind
from dflash_hf.data.sources import nemo_cut_id
from dflash_hf.data.user_text import UserTextCheck

logger = logging.getLogger("dflash_hf.generate_labels")


def shard_of(records: list, num_shards: int, shard_index: int) -> list:
    """Part `shard_index` of `num_shards` contiguous, near-equal parts of `records` (the last ones may be empty)."""
    size = -(-len(records) // num_shards)
    return records[shard_index * size : (shard_index + 1) * size]


def manifest_rows(manifest: Path, bad: BadSamples) -> Iterator[tuple[str, str, dict]]:
    """``(cut id, origin, record)`` of every row of `manifest` (`json_rows`; a line that is not a row goes to `bad`),
    the cut id the one training gives the line."""
    stem = manifest_stem(manifest)
    for index, origin, record in json_rows(manifest, bad, id_prefix=stem):
        yield nemo_cut_id(record, f"{stem}-{index:08d}"), origin, record


def check_output(manifest: str, output: str) -> None:
    """``--output`` must not be the manifest (same path, or the same file under another name), nor a directory, and
    its directory must exist."""
    out, src = Path(output), Path(manifest)
    if out.resolve() == src.resolve() or (out.exists() and src.exists() and os.path.samefile(out, src)):
        raise ValueError(
            f"field 'output': {output!r} is the input manifest {manifest!r}; the generated labels go to a new file: "
            "give another --output"
        )
    if out.is_dir():
        raise IsADirectoryError(f"field 'output': {output!r} is a directory; give a file path for the new manifest")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"field 'output': the directory of {output!r} does not exist; create it first")


def is_text_row(record: dict | None) -> bool:
    """A text target's row: a ``text`` and no audio (no ``audio_filepath``, not a lhotse cut)."""
    return record is not None and isinstance(record.get("text"), str) and not {"audio_filepath", "type"} & set(record)


def check_rows_fit(manifest: str, family, record: dict | None) -> None:
    """The manifest's rows are what the target reads (from its first row, `record`: `json_rows.first_valid_record`):
    audio rows for an audio target, rows without audio for a text target (its prompt is the line's ``context``).
    Checked before the target loads."""
    if record is None:
        return
    if family.has_audio and is_text_row(record):
        raise ValueError(
            f"field 'manifest': the rows of {manifest!r} have no audio (a text target's rows: text, context), but "
            f"the target is an audio target (family {family.name}): give a NeMo manifest of audio rows "
            "(audio_filepath, duration, text)"
        )
    if not family.has_audio and "audio_filepath" in record:
        raise ValueError(
            f"field 'manifest': the rows of {manifest!r} have audio (audio_filepath), but the target is a text target "
            "(it would label every row from --prompt alone, the audio unread): give rows of text and context, or an "
            "audio target"
        )


def check_manifest(manifest: str, record: dict | None) -> None:
    """``--manifest`` is a NeMo manifest with at least one row (from its first JSON object line, `record`:
    `json_rows.first_valid_record`): audio rows, or a text target's rows (a ``text``, a ``context``, no audio;
    `quality_steps.prompts` writes them)."""
    if is_text_row(record):
        return
    try:
        kind = record_kind(record, manifest)
    except ValueError as e:
        raise ValueError(f"field 'manifest': {e}") from None
    if kind != "nemo":
        raise ValueError(
            f"field 'manifest': {manifest!r} is a lhotse cuts file; dflash-generate-labels reads NeMo manifests "
            "(JSON lines with audio_filepath, duration, text): write the cuts as one"
        )


def partial_path(output: Path) -> Path:
    """Where the lines are written until the output is complete (an interrupted run leaves it; the next resumes)."""
    return output.with_name(output.name + ".partial")


def earlier_file(output: Path) -> Path:
    """The file an earlier run left: ``<output>.partial`` when an interrupted run left one, else the output."""
    return partial_path(output) if partial_path(output).exists() else output


# what a labelled line keeps of its row beside the reference text, as the target read it (a line's `context` and
# `system_prompt`: the conversation's keys, `LabelJob`)
ROW_KEYS = (
    "audio_filepath",
    "offset",
    "duration",
    ConversationConfig.context_key,
    ConversationConfig.system_prompt_key,
)
# the rows of an earlier run's lines: id -> ``(line number, row_fields)`` of each line of that id
EarlierRows = dict[str, list[tuple[int, dict]]]


def row_fields(record: dict, audio_dir: str, reference_key: str, labelled: bool) -> dict:
    """What says which row `record` is (a manifest row, or a `labelled` line): its reference text (a row's ``text``, a
    line's `reference_key`, never a field of the line: `LabelSettings` refuses those; a line without that key, written
    with another --reference_key, is matched by the rest), its audio as an absolute path (a relative path is relative to
    `audio_dir`, resolved: the manifest's directory, or the output's, where `relocate` re-expressed a line's path) and
    the other `ROW_KEYS` it has."""
    fields = {key: record[key] for key in ROW_KEYS if key in record}
    if not labelled or reference_key in record:
        fields["text"] = record[reference_key] if labelled else record.get("text")
    if isinstance(fields.get("audio_filepath"), str):
        fields["audio_filepath"] = os.path.normpath(os.path.join(audio_dir, fields["audio_filepath"]))
    return fields


def same_row(line: dict, row: dict) -> bool:
    """Whether a labelled line's `row_fields` are the manifest row's (its reference text where the line has it)."""
    return line == (row if "text" in line else {k: v for k, v in row.items() if k != "text"})


def earlier_lines(output: Path, reference_key: str, warn: bool = True) -> tuple[list[str], EarlierRows]:
    """The complete lines an earlier run wrote (of `earlier_file`), and their rows: each id with its lines' numbers
    and `row_fields` (the original text under `reference_key`). A last line without its newline (an interrupted write)
    is left out, its row labelled again (with a warning unless `warn` is False); a line that is not a labelled row (no
    ``id``) is an error: the file is not this tool's output."""
    source = earlier_file(output)
    if not source.exists():
        return [], {}
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        if warn:
            logger.warning("%s: the last line is incomplete (an interrupted write); its row is labelled again", source)
        lines.pop()
    rows: EarlierRows = {}
    output_dir = str(output.parent.resolve())
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            record = e
        if not isinstance(record, dict) or not isinstance(record.get("id"), str):
            raise ValueError(
                f"field 'output': {str(source)!r} line {number} is not a row dflash-generate-labels wrote (a JSON "
                "object with a string 'id'); give a new --output (the file is left as it is)"
            )
        fields = row_fields(record, output_dir, reference_key, labelled=True)
        rows.setdefault(record["id"], []).append((number, fields))
    return lines, rows


def check_earlier_rows(
    output: Path,
    done: EarlierRows,
    rows: list[tuple[str, dict | None]],
    manifest: str,
    reference_key: str,
    num_shards: int,
    shard_index: int,
    skipped: int = 0,
) -> None:
    """The rows an earlier run wrote (`done`, read by `earlier_lines`) are all rows of this run (`rows`: the
    ``(id, record)`` of the rows of `manifest`, of shard `shard_index` of `num_shards`, less `skipped` bad ones; the
    record may be None where its id is not in `done`), each line the row its id names (`row_fields`: a manifest
    edited since, or ids by position shifted by a deleted or inserted line, name other rows): resuming keeps the
    earlier lines, so lines of another manifest, shard or row would end up in the output. Refused, the file left as
    it is."""
    source = str(earlier_file(output))
    foreign = done.keys() - {cut_id for cut_id, _ in rows}
    if foreign:
        shard = f" (--num_shards {num_shards} --shard_index {shard_index})" if num_shards > 1 else ""
        less = f", less the {skipped} skipped as bad" if skipped else ""
        examples = ", ".join(repr(cut_id) for cut_id in sorted(foreign)[:3])
        raise ValueError(
            f"field 'output': {source!r} holds {len(foreign)} labelled "
            f"{'row that is not a row' if len(foreign) == 1 else 'rows that are not rows'} of --manifest {manifest!r}"
            f"{shard}{less} (e.g. {examples}): it was written from another manifest or shard, and "
            "resuming would keep them in the output; give a new --output, or the --manifest (and --num_shards / "
            "--shard_index) that wrote it (the file is left as it is)"
        )
    manifest_dir = str(Path(manifest).parent.resolve())
    wanted: dict[str, list[dict]] = {}
    for cut_id, record in rows:
        if cut_id in done and record is not None:
            wanted.setdefault(cut_id, []).append(row_fields(record, manifest_dir, reference_key, labelled=False))
    differ = sorted(
        (number, cut_id, fields)
        for cut_id, lines in done.items()
        for number, fields in lines
        if not any(same_row(fields, row) for row in wanted[cut_id])
    )
    if not differ:
        return
    number, cut_id, fields = differ[0]
    row = wanted[cut_id][0]
    missing = object()
    keys = sorted(k for k in fields.keys() | row.keys() if fields.get(k, missing) != row.get(k, missing))
    keys = [k for k in keys if k != "text" or k in fields]  # a line without its reference text is matched by the rest
    named = ", ".join(repr(reference_key if k == "text" else k) for k in keys)
    one = len(differ) == 1
    raise ValueError(
        f"field 'output': {source!r} holds {len(differ)} labelled row{'s' * (not one)} that "
        f"{'is not the row its id names' if one else 'are not the rows their ids name'} in --manifest {manifest!r} "
        f"(e.g. line {number}, id {cut_id!r}: its {named} {'differs' if len(keys) == 1 else 'differ'} from the "
        "manifest row's): the manifest changed since, or its ids by position (lines without an 'id') shifted with a "
        "line deleted or inserted, and resuming would keep labels of other rows; give a new --output, or the "
        "--manifest that wrote it (the file is left as it is)"
    )


def check_resumable(
    manifest: str, output: str, reference_key: str, num_shards: int, shard_index: int, skip_bad_samples: bool
) -> None:
    """Before the target loads, where an earlier run left lines for `output` (`earlier_file`, its original texts
    under `reference_key`): they are rows of `manifest`, each the row its id names (`check_earlier_rows`), of its shard
    `shard_index` of `num_shards` unless `skip_bad_samples` (rows skipped for a problem only the target's tokenizer
    finds, `record_problem`, move the shards' bounds: the run checks its shard once its rows are read). A line that is
    not a row stops here, as in the run (or, skipped, is warned about here and by the run)."""
    _, done = earlier_lines(Path(output), reference_key, warn=False)
    if not done:
        return
    bad = BadSamples(skip=skip_bad_samples)
    rows = [(cut_id, record if cut_id in done else None) for cut_id, _, record in manifest_rows(Path(manifest), bad)]
    if skip_bad_samples:
        num_shards, shard_index = 1, 0
    part = shard_of(rows, num_shards, shard_index)
    check_earlier_rows(Path(output), done, part, manifest, reference_key, num_shards, shard_index)


def start_partial(output: Path, lines: list[str]) -> Path:
    """``<output>.partial`` holding `lines` (written beside it and renamed in, so a kill never loses them)."""
    partial = partial_path(output)
    staged = partial.with_name(partial.name + ".tmp")
    with open(staged, "w", encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staged, partial)
    return partial


def record_problem(record: dict, renderer: ConversationRenderer, check: UserTextCheck) -> tuple[str, str, str] | None:
    """``(field, problem, fix)`` of a row the prompt or the output file cannot take: a control token or a lone
    surrogate in the text fields that go into the prompt, a lone surrogate anywhere (not writable as UTF-8)."""
    for key in (renderer.config.context_key, renderer.config.system_prompt_key):
        if isinstance(record.get(key), str):
            problem = check.problem(key, record[key])
            if problem:
                return problem
    for key, value in record.items():
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            return (
                key,
                f"holds a lone UTF-16 surrogate ({e.reason}), which is not text",
                "write the value as valid UTF-8 text",
            )
    return None


def relocate(audio_filepath: str, manifest_dir: Path, output_dir: Path) -> str:
    """A relative audio path, re-expressed relative to the output manifest (absolute paths unchanged)."""
    path = Path(audio_filepath)
    if path.is_absolute():
        return audio_filepath
    return os.path.relpath(manifest_dir.resolve() / path, output_dir.resolve())


@dataclass
class LabelCounts:
    """What a run wrote: rows, rows cut by `max_new_tokens` (marked `truncated`), rows whose ids are kept as
    `label_ids` (their text re-encodes to other tokens), rows whose ids could not be kept (named in a warning)."""

    written: int = 0
    truncated: int = 0
    label_ids: int = 0
    ids_not_kept: int = 0

    def summary(self, output: str) -> str:
        return (
            f"wrote {self.written} generated labels to {output}: {self.truncated} cut by --max_new_tokens (marked "
            f"'truncated': trained without an end of turn; raise --max_new_tokens to let them end), {self.label_ids} "
            "whose text re-encodes to other tokens than the target wrote (its ids kept as 'label_ids', which "
            "training uses)" + (f", {self.ids_not_kept} whose ids could not be kept" if self.ids_not_kept else "")
        )


def generated_line(
    cut, ids: list[int], ends: set[int], renderer: ConversationRenderer, counts: LabelCounts, audio_id: int | None
) -> dict:
    """The output fields of one row: `text`, and `truncated` / `label_ids` where they apply (`counts` counts them).
    `ids`: the target's new tokens (padded with its end token); `renderer`: as training renders the row; `audio_id`:
    the target's audio placeholder."""
    tokenizer = renderer.tokenizer
    end = next((i for i, t in enumerate(ids) if t in ends), None)
    ids = ids if end is None else ids[:end]
    line = {"text": decoded_response(tokenizer, ids)}
    if end is None:
        line[TRUNCATED_KEY] = True
        counts.truncated += 1
    if not line["text"]:
        return line
    custom = {**(cut.custom or {}), LABEL_IDS_KEY: ids, TRUNCATED_KEY: end is None}
    labelled = dataclasses.replace(
        cut, supervisions=[dataclasses.replace(cut.supervisions[0], text=line["text"])], custom=custom
    )
    try:
        problem = generated_problem(labelled, tokenizer, line["text"], audio_id)
        if problem:
            raise ValueError(f"field {problem[0]!r}: {problem[1]}")
        changed = renderer.render(labelled).text_suffix_ids is not None
    except ValueError as e:
        logger.warning(
            "row %r: the target's own ids cannot be kept beside its text (%s); trained on the text", cut.id, e
        )
        counts.ids_not_kept += 1
        return line
    if changed:
        line[LABEL_IDS_KEY] = ids
        counts.label_ids += 1
    return line


__all__ = [
    "ROW_KEYS",
    "EarlierRows",
    "LabelCounts",
    "check_earlier_rows",
    "check_manifest",
    "check_output",
    "check_resumable",
    "check_rows_fit",
    "earlier_file",
    "earlier_lines",
    "generated_line",
    "manifest_rows",
    "partial_path",
    "record_problem",
    "relocate",
    "row_fields",
    "same_row",
    "shard_of",
    "start_partial",
]
