"""`TargetFamily`: the hooks every row must give are checked when a row is made; the optional fast paths are
listed apart (a row without them takes the generic path)."""

from __future__ import annotations

import dataclasses

import pytest

from dflash_hf.targets.families.base import FAST_PATH_HOOKS, TargetFamily, family_problems
from dflash_hf.targets.families.registry import FAMILIES


def _row(**kw) -> TargetFamily:
    base = dict(name="x", model_types=("x",), expansion="processor", audio_kwargs=("input_features",))
    return TargetFamily(**(base | {"encode": lambda *a: {}, "audio_tokens": lambda config, n: n} | kw))


def test_every_registered_row_gives_its_required_hooks():
    assert all(family_problems(family) == [] for family in FAMILIES.values())
    fields = {f.name for f in dataclasses.fields(TargetFamily)}
    assert set(FAST_PATH_HOOKS) <= fields


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        (dict(audio_tokens=None), "audio rows require audio_tokens"),
        (dict(expansion="encoder"), "encoder-decoder rows require render_decoder and decoder_config"),
        (dict(expansion="decoder"), "expansion must be one of"),
        (dict(render_with="template"), "render_with must be 'processor' or 'tokenizer'"),
        (dict(host_facts=lambda model, batch: None), "host_facts and forward_inputs come together"),
    ],
)
def test_a_row_missing_a_required_hook_is_refused_naming_it(kw, problem):
    with pytest.raises(ValueError, match=rf"target family 'x': .*{problem}"):
        _row(**kw)


def test_a_text_row_needs_no_audio_hooks_and_no_fast_paths():
    row = _row(expansion="none", audio_kwargs=(), audio_tokens=None)
    assert not row.has_audio and not any(getattr(row, name) for name in FAST_PATH_HOOKS)
