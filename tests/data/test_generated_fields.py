"""`label_ids` and `truncated` of a generated-labels manifest in the training data path (dflash_hf.data.generated)."""

import json

import numpy as np
import pytest
import soundfile as sf

from dflash_hf.data import BadSampleError, BadSamples, build_train_dataloader
from dflash_hf.data.collator import PaddedCollator
from dflash_hf.data.conversation import ConversationConfig, ConversationRenderer
from dflash_hf.data.sample_checks import SampleValidator
from dflash_hf.data.sources import open_source
from dflash_hf.settings import DataSettings
from dflash_hf.targets.families.registry import resolve_family
from dflash_hf.testing import tiny


def _manifest(tmp_path, rows):
    audio = (0.1 * np.random.default_rng(0).standard_normal(16000)).astype(np.float32)
    sf.write(tmp_path / "a.wav", audio, 16000)
    lines = [{"audio_filepath": "a.wav", "duration": 1.0, "id": f"r{i}", **r} for i, r in enumerate(rows)]
    path = tmp_path / "m.json"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _parts(asr_target, **validator_kw):
    model, processor = asr_target
    family = resolve_family(model.config)
    renderer = ConversationRenderer(processor, family, ConversationConfig())
    validator = SampleValidator(renderer, family, model.config, max_tokens=None, bad=BadSamples(), **validator_kw)
    return validator, PaddedCollator(processor, model.config, family, renderer, "left")


def _rows(path, asr_target, **validator_kw):
    """Each manifest row collated on its own: its real ids, its supervised ids and the sampler's token count."""
    validator, collate = _parts(asr_target, **validator_kw)
    out = []
    for cut in open_source(path):
        cut = validator(cut)
        batch = collate([cut])
        real = batch["attention_mask"][0].bool()
        ids = batch["input_ids"][0][real].tolist()
        sup = batch["loss_mask"][0][real].tolist()
        out.append((ids, [i for i, s in zip(ids, sup) if s], validator.count_tokens(cut)))
    return out


def _loader(path, asr_target, **kw):
    model, processor = asr_target
    return build_train_dataloader(str(path), processor, model.config, max_tokens=2000, shuffle=False, **kw)


def test_label_ids_replace_the_texts_tokens_and_truncated_rows_have_no_end(tmp_path, asr_target):
    tok = asr_target[1].tokenizer
    end = tok.convert_tokens_to_ids(tiny.IM_END)
    text_ids = tok("yes no", add_special_tokens=False)["input_ids"]
    written = tok(" yes no", add_special_tokens=False)["input_ids"]  # the target wrote a leading space
    path = _manifest(
        tmp_path,
        [
            {"text": "yes no"},
            {"text": "yes no", "label_ids": written},
            {"text": "yes no", "truncated": True},
            {"text": "yes no", "label_ids": written, "truncated": True},
            {"text": "yes no", "label_ids": text_ids, "truncated": False},  # the same ids as the text's
        ],
    )
    rows = _rows(path, asr_target)
    plain_ids, plain_sup, _ = rows[0]
    assert plain_sup == text_ids + [end]
    assert rows[1][1] == written + [end]
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    assert rows[1][0][-len(written) - 1 - len(newline) :] == written + [end] + newline
    assert rows[1][0][: -len(written) - 1 - len(newline)] == plain_ids[: -len(text_ids) - 1 - len(newline)]
    assert rows[2][1] == text_ids and rows[2][0][-len(text_ids) :] == text_ids  # no end of turn at all
    assert rows[3][1] == written and rows[3][0][-len(written) :] == written
    assert rows[4] == rows[0]
    audio = asr_target[1].tokenizer.convert_tokens_to_ids(tiny.AUDIO_PAD)
    n_audio = rows[0][2] - (len(plain_ids) - plain_ids.count(audio))
    for ids, _, count in rows:  # the sampler's token counts are the collated rows' lengths
        assert count == len(ids) - ids.count(audio) + n_audio


def test_label_ids_in_a_padded_batch_keep_every_row_aligned(tmp_path, asr_target):
    tok = asr_target[1].tokenizer
    longer = tok(" yes  no", add_special_tokens=False)["input_ids"]  # decodes to "yes  no"
    path = _manifest(tmp_path, [{"text": "yes no"}, {"text": "yes  no", "label_ids": longer}])
    model, processor = asr_target
    for side in ("left", "right"):
        loader = build_train_dataloader(
            str(path), processor, model.config, max_tokens=4000, shuffle=False, padding_side=side
        )
        (batch,) = list(loader)
        real = batch["attention_mask"].bool()
        rows = [batch["input_ids"][r][real[r]].tolist() for r in range(2)]
        sup = [batch["input_ids"][r][batch["loss_mask"][r]].tolist() for r in range(2)]
        assert sorted(sup, key=len)[1][:-1] == longer
        assert int(real.sum()) == sum(len(r) for r in rows)
        assert bool(real[:, -1].all()) if side == "left" else bool(real[:, 0].all())


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"text": "yes no!", "label_ids": "IDS"}, "not a non-empty list"),
        ({"text": "yes no!", "label_ids": []}, "not a non-empty list"),
        ({"text": "yes no!", "label_ids": [1, True]}, "not a non-empty list"),
        ({"text": "yes no!", "label_ids": [99999]}, "outside the tokenizer's vocabulary"),
        ({"text": "yes no!", "label_ids": "END"}, "end token"),
        ({"text": "yes no!", "label_ids": "AUDIO"}, "audio placeholder"),
        ({"text": "yes no!", "label_ids": "EDITED"}, "not the row's text"),
        ({"text": "yes no!", "truncated": "yes"}, "not true or false"),
    ],
)
def test_unusable_generated_fields_are_bad_samples_naming_the_field(tmp_path, asr_target, fields, problem):
    tok = asr_target[1].tokenizer
    ids = tok("yes no!", add_special_tokens=False)["input_ids"]
    if fields.get("label_ids") == "END":
        fields["label_ids"] = ids + [tok.eos_token_id]
    elif fields.get("label_ids") == "AUDIO":
        fields["label_ids"] = ids[:2] + [tok.convert_tokens_to_ids(tiny.AUDIO_PAD)] + ids[2:]
    elif fields.get("label_ids") == "EDITED":
        fields["label_ids"] = tok("yes no", add_special_tokens=False)["input_ids"]
    path = _manifest(tmp_path, [fields])
    field = "truncated" if "truncated" in fields else "label_ids"
    with pytest.raises(BadSampleError, match=rf"field '{field}': .*{problem}"):
        list(_loader(path, asr_target))


def test_a_whisper_rows_label_ids_make_the_targets_own_stream(tmp_path):
    """Whisper writes the space before its transcript itself (the template renders `prompt + " " + text`): a row with
    the target's ids is its stream, prompt + ids + end, the template's space replaced, not kept beside them."""
    from utils import tiny_whisper

    whisper = tiny_whisper()
    tok = whisper[1].tokenizer
    prompt = tok.convert_tokens_to_ids([tiny.WHISPER_SOT, "<|en|>", "<|transcribe|>", tiny.WHISPER_NO_TIMESTAMPS])
    written = tok(" yes no", add_special_tokens=False)["input_ids"]  # the space is a token of its own here
    path = _manifest(tmp_path, [{"text": "yes no"}, {"text": "yes no", "label_ids": written}])
    (plain, _, _), (labelled, supervised, _) = _rows(path, whisper)
    assert labelled == plain == prompt + written + [tok.eos_token_id]  # not prompt + [space] + written + end
    assert supervised == written + [tok.eos_token_id]


def test_label_ids_replace_a_separating_space_token_but_not_one_merged_into_the_first_word():
    """`splice_response` on a template's suffix `" yes no<end>"`: a byte-level tokenizer's space token before the
    response is replaced with it; a BPE whose first word carries the space (Whisper's real one) has none to replace;
    template text before the response stays."""
    from dflash_hf.data.generated import splice_response

    suffix = " yes no<e>"
    spaced = [32, 121, 101, 115, 32, 110, 111, 900]  # byte-level: the space a token of its own
    offsets = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 10)]
    supervised = [False, True, True, True, True, True, True, False]
    ids, flags = splice_response("c", suffix, spaced, offsets, supervised, "yes no", spaced[:7])
    assert ids == spaced and flags == [True] * 7 + [False]
    merged = [1000, 1001, 900]  # BPE: "Ġyes", "Ġno", end
    ids, flags = splice_response("c", suffix, merged, [(0, 4), (4, 7), (7, 10)], [True, True, False], "yes no", [7, 8])
    assert ids == [7, 8, 900] and flags == [True, True, False]
    marked = "A: yes no<e>"  # template text, then a space, before the response
    ids, flags = splice_response(
        "c", marked, [65, 58, 32, 1000, 900], [(0, 1), (1, 2), (2, 3), (3, 9), (9, 12)], [False] * 3 + [True, False],
        "yes no", [7, 8],
    )  # fmt: skip
    assert ids == [65, 58, 7, 8, 900] and flags == [False, False, True, True, False]


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"truncated": "yes"}, "'truncated': is 'yes', not true or false"),
        ({"label_ids": "IDS"}, "'label_ids': is 'IDS', not a non-empty list"),
        ({"label_ids": []}, "'label_ids': is \\[\\], not a non-empty list"),
        ({"label_ids": [1, True]}, "'label_ids': .*not a non-empty list"),
        ({"label_ids": [5, -1]}, "'label_ids': holds negative ids \\[-1\\]"),
    ],
)
def test_malformed_generated_fields_are_found_when_the_source_is_opened(tmp_path, fields, problem):
    """The type checks of `label_ids` / `truncated` need no tokenizer: the readers' row pre-flight (NeMo manifest and
    lhotse cuts file) refuses them before any target loads, or counts them with --skip_bad_samples."""
    from lhotse import CutSet, MonoCut
    from lhotse.supervision import SupervisionSegment

    nemo = _manifest(tmp_path, [{"text": "yes no"}, {"text": "yes no", **fields}])
    sup = SupervisionSegment(id="c", recording_id="c", start=0.0, duration=0.0, text="yes no")
    cuts = tmp_path / "cuts.jsonl.gz"
    CutSet.from_cuts([MonoCut(id="c", start=0.0, duration=0.0, channel=0, supervisions=[sup], custom=fields)]).to_file(
        cuts
    )
    for path in (nemo, cuts):
        with pytest.raises(BadSampleError, match=f"field {problem}"):
            open_source(path)  # the rows are checked as the source opens
        bad = BadSamples(skip=True)
        assert len(list(open_source(path, bad))) == (1 if path == nemo else 0) and len(bad.skipped) == 1


def test_a_truncated_generated_row_is_exempt_from_the_characters_per_second_check(tmp_path, asr_target):
    """A target looping until --max_new_tokens writes far more than 50 characters a second of its audio: the row is
    its own output (marked `truncated`), not a wrong duration, so it is trained on; the same text unmarked is refused,
    when the source opens (a line with its duration) and in the validator (a duration read from the file)."""
    loop = " ".join(["okay"] * 40)  # 199 characters for 1 s of audio
    rate = dict(
        max_chars_per_second=DataSettings.max_chars_per_second
    )  # the reader's default; the validator's as trained
    for duration in (1.0, None):
        path = _manifest(tmp_path, [{"text": loop, "truncated": True, "duration": duration}])
        ((ids, supervised, _),) = _rows(path, asr_target, **rate)
        assert asr_target[1].tokenizer.decode(supervised) == loop  # no end of turn: truncated
        path = _manifest(tmp_path, [{"text": loop, "duration": duration}])
        with pytest.raises(BadSampleError, match=r"field 'text': has 199 characters for 1(\.0+)? s of audio"):
            _rows(path, asr_target, **rate)
    from lhotse import CutSet, MonoCut, Recording
    from lhotse.supervision import SupervisionSegment

    from dflash_hf.data.lhotse_cuts import LhotseCuts

    rec = Recording(id="a", sources=[], sampling_rate=16000, num_samples=16000, duration=1.0)
    sup = SupervisionSegment(id="c", recording_id="a", start=0.0, duration=1.0, text=loop)
    for custom, kept in (({"truncated": True}, 1), ({}, None)):
        cut = MonoCut(id="c", start=0.0, duration=1.0, channel=0, supervisions=[sup], recording=rec, custom=custom)
        CutSet.from_cuts([cut]).to_file(tmp_path / "cuts.jsonl.gz")
        reader = LhotseCuts(tmp_path / "cuts.jsonl.gz", **rate)
        if kept:
            assert len(list(reader)) == kept
        else:
            with pytest.raises(BadSampleError, match="field 'text': has 199 characters"):
                reader.check()
