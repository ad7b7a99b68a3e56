"""`targets/processor.py`: the label target loader refuses a checkpoint that leaves parameters at random."""

import pytest
from safetensors.torch import load_file, save_file

from dflash_hf.targets.processor import load_label_target
from dflash_hf.testing import tiny


@pytest.mark.parametrize("kind", ["text", "qwen3_asr"])
def test_the_label_target_must_be_complete(tmp_path, kind):
    path = tiny.save_tiny_target(tmp_path / kind, kind=kind)
    model, _, family = load_label_target(str(path), None, "float32", "cpu")
    assert not model.training and family.has_audio == (kind == "qwen3_asr")
    weights = load_file(path / "model.safetensors")
    dropped = next(k for k in weights if "layers.0.mlp.down_proj" in k)
    del weights[dropped]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 parameters.*down_proj.*Point --model at a complete checkpoint\.$"):
        load_label_target(str(path), None, "float32", "cpu")
