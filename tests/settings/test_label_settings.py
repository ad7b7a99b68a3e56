"""`LabelSettings` refuses values that would make `dflash-generate-labels` write a wrong line."""

from __future__ import annotations

import pytest

from dflash_hf.settings.labels import LINE_FIELDS, LabelSettings


@pytest.mark.parametrize("key", ["text", "id", "audio_filepath", "context", "label_ids", ""])
def test_a_reference_key_that_is_a_field_of_the_line_is_refused(key):
    with pytest.raises(ValueError, match="field 'reference_key' must name a new field of the output line"):
        LabelSettings(model="m", manifest="a.json", output="b.json", reference_key=key)


def test_the_default_and_another_new_name_pass():
    assert LabelSettings(model="m", manifest="a.json", output="b.json").reference_key not in LINE_FIELDS
    assert LabelSettings(model="m", manifest="a.json", output="b.json", reference_key="orig").reference_key == "orig"
