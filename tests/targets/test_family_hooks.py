"""`TargetFamily`: a family class without the hooks its kind requires is refused when it is defined, naming them; the
optional fast paths are listed apart (a family without them takes the generic path)."""

from __future__ import annotations

import pytest

from dflash_hf.targets.families.base import FAST_PATH_HOOKS, EncoderDecoderFamily, TargetFamily, family_problems
from dflash_hf.targets.families.registry import FAMILIES, FAMILY_CLASSES


def _family(base: type[TargetFamily] = TargetFamily, **attributes) -> type[TargetFamily]:
    """A family class named 'x' (an audio family with `encode` and `audio_tokens`, unless `attributes` change it)."""
    body = dict(
        name="x",
        model_types=("x",),
        expansion="processor",
        audio_kwargs=("input_features",),
        encode=lambda self, *a: {},
        audio_tokens=staticmethod(lambda config, n: n),
    )
    return type("X", (base,), {key: value for key, value in (body | attributes).items() if value is not None})


def test_every_registered_family_gives_its_required_hooks():
    assert all(family_problems(cls) == [] for cls in FAMILY_CLASSES)
    assert [family.name for family in FAMILIES.values()] == [cls.name for cls in FAMILY_CLASSES]
    assert all(hasattr(TargetFamily, name) for name in FAST_PATH_HOOKS)


@pytest.mark.parametrize(
    ("attributes", "problem"),
    [
        (dict(encode=None), "encode is required"),
        (dict(audio_tokens=None), "audio families require audio_tokens"),
        (dict(expansion="encoder"), "encoder-decoder families subclass EncoderDecoderFamily"),
        (dict(expansion="decoder"), "expansion must be one of"),
        (dict(render_with="template"), "render_with must be 'processor' or 'tokenizer'"),
        (dict(host_facts=lambda self, model, batch: None), "host_facts and forward_inputs come together"),
    ],
)
def test_a_family_missing_a_required_hook_is_refused_naming_it(attributes, problem):
    with pytest.raises(TypeError, match=rf"target family 'x': .*{problem}"):
        _family(**attributes)


def test_an_encoder_decoder_family_needs_its_decoder_renderer_and_config():
    with pytest.raises(TypeError, match="encoder-decoder families require render_decoder and decoder_config"):
        _family(EncoderDecoderFamily, expansion=None, audio_tokens=None)
    family = _family(
        EncoderDecoderFamily,
        expansion=None,
        audio_tokens=None,
        render_decoder=staticmethod(lambda tokenizer, messages, add_generation_prompt=False: ""),
        decoder_config=staticmethod(lambda config: "decoder"),
    )()
    assert family.is_encoder_decoder and family.audio_tokens(None, 16000) == 0  # the audio is the encoder's
    assert family.text_config(None) == "decoder"


def test_a_text_family_needs_no_audio_hooks_and_takes_no_fast_paths():
    family = _family(expansion="none", audio_kwargs=(), audio_tokens=None)()
    assert not family.has_audio
    assert not any(getattr(family, name) is True or family.overrides(name) for name in FAST_PATH_HOOKS)
    assert family.host_facts(None, {}) is None and family.window_frames(None) is None
    with pytest.raises(NotImplementedError, match="family 'x' has no audio"):
        family.audio_tokens(None, 16000)
