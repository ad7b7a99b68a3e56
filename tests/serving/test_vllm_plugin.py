"""The vLLM plugin (`dflash_hf[vllm]`): declared as a `vllm.general_plugins` entry point, registers SupportsEagle3
variants of vLLM's audio LLMs under vLLM's own architecture names, and never makes `dflash_hf` import vLLM.

Without vLLM the registration and the variants run against a stand-in of the few vLLM names they use; with vLLM
importable the last tests run them against the real one."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from torch import nn
from utils import REPO_ROOT

from dflash_hf.serving import vllm_plugin

FAMILY_ARCHS = {"Qwen2AudioForConditionalGeneration", "VoxtralForConditionalGeneration"}


def test_the_entry_point_and_the_extra_are_declared():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    ref = project["entry-points"][vllm_plugin.ENTRY_POINT_GROUP][vllm_plugin.ENTRY_POINT_NAME]
    module, _, function = ref.partition(":")
    assert getattr(importlib.import_module(module), function) is vllm_plugin.register
    assert any(req.replace(" ", "").startswith("vllm>=0.33") for req in project["optional-dependencies"]["vllm"])


@pytest.mark.slow  # 6 s on 2 busy cores (a fresh interpreter)
def test_importing_dflash_hf_and_the_plugin_never_imports_vllm(tmp_path):
    poisoned = tmp_path / "vllm"
    poisoned.mkdir()
    (poisoned / "__init__.py").write_text("raise ImportError('vllm imported')\n")
    code = textwrap.dedent(
        """
        import sys
        import dflash_hf
        from dflash_hf import DFlashDraftModel
        from dflash_hf.serving import vllm_plugin
        assert vllm_plugin.variant_refs()
        assert "vllm" not in sys.modules
        try:
            vllm_plugin.register()
        except ImportError as err:
            print("register:", err)
        """
    )
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "register: vllm imported" in proc.stdout  # only register() imports vLLM


class _Registry:
    """Stand-in of vLLM's `ModelRegistry`: its supported architectures and what was registered."""

    def __init__(self, archs):
        self.models = dict.fromkeys(archs, "vllm's own")

    def get_supported_archs(self):
        return self.models.keys()

    def register_model(self, arch, ref):
        self.models[arch] = ref


def test_register_maps_vllms_audio_llm_architectures_to_the_variants(monkeypatch):
    registry = _Registry(["Qwen2AudioForConditionalGeneration", "VoxtralForConditionalGeneration", "LlamaForCausalLM"])
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(ModelRegistry=registry))
    assert vllm_plugin.register() == ["Qwen2AudioForConditionalGeneration", "VoxtralForConditionalGeneration"]
    assert vllm_plugin.register() == ["Qwen2AudioForConditionalGeneration", "VoxtralForConditionalGeneration"]
    module = "dflash_hf.serving.vllm_models"
    assert registry.models == {
        "Qwen2AudioForConditionalGeneration": f"{module}:Qwen2AudioForConditionalGenerationWithHiddenStates",
        "VoxtralForConditionalGeneration": f"{module}:VoxtralForConditionalGenerationWithHiddenStates",
        "LlamaForCausalLM": "vllm's own",  # architectures that serve DFlash already are left alone
    }
    assert FAMILY_ARCHS <= set(vllm_plugin.HIDDEN_STATE_VARIANTS)
    for arch, (module, variant) in vllm_plugin.HIDDEN_STATE_VARIANTS.items():
        assert module.startswith("vllm.model_executor.models.") and variant == f"{arch}WithHiddenStates"


# --- The variants, against a stand-in of the vLLM names they use ---------------------------------------------------
class _EagleModelMixin:
    aux_hidden_state_layers: tuple[int, ...] = ()

    def _set_aux_hidden_state_layers(self, layers):
        self.aux_hidden_state_layers = tuple(sorted(set(layers)))


class _SupportsEagle3:
    supports_eagle3 = True

    def set_aux_hidden_state_layers(self, layers):  # vLLM's default: the language model's decoder keeps them
        self.get_language_model().model._set_aux_hidden_state_layers(layers)


class _Decoder(nn.Module, _EagleModelMixin):
    def __init__(self, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Identity() for _ in range(num_layers))


class _LanguageModel(nn.Module):
    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.model = decoder


class _Qwen2Audio(nn.Module):
    """vLLM's Qwen2-Audio as far as the variant sees it: a language model whose decoder collects hidden states."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.language_model = _LanguageModel(decoder)

    def get_language_model(self):
        return self.language_model


@pytest.fixture
def stand_in_vllm(monkeypatch):
    interfaces = types.ModuleType("vllm.model_executor.models.interfaces")
    interfaces.EagleModelMixin, interfaces.SupportsEagle3 = _EagleModelMixin, _SupportsEagle3
    qwen2_audio = types.ModuleType("vllm.model_executor.models.qwen2_audio")
    qwen2_audio.Qwen2AudioForConditionalGeneration = _Qwen2Audio
    for name, module in (
        ("vllm", types.ModuleType("vllm")),
        ("vllm.model_executor", types.ModuleType("vllm.model_executor")),
        ("vllm.model_executor.models", types.ModuleType("vllm.model_executor.models")),
        ("vllm.model_executor.models.interfaces", interfaces),
        ("vllm.model_executor.models.qwen2_audio", qwen2_audio),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "dflash_hf.serving.vllm_models", raising=False)
    yield importlib.import_module("dflash_hf.serving.vllm_models")
    sys.modules.pop("dflash_hf.serving.vllm_models", None)


def test_variant_is_vllms_class_with_the_hidden_state_interface(stand_in_vllm):
    cls = stand_in_vllm.Qwen2AudioForConditionalGenerationWithHiddenStates
    assert cls is stand_in_vllm.Qwen2AudioForConditionalGenerationWithHiddenStates  # built once
    assert issubclass(cls, _Qwen2Audio) and issubclass(cls, _SupportsEagle3) and cls.supports_eagle3
    assert cls.__module__ == "dflash_hf.serving.vllm_models" and cls.__qualname__ == cls.__name__
    model = cls(_Decoder(num_layers=4))
    model.set_aux_hidden_state_layers((2, 4, 1))  # DFlash taps [0, 1, 3] + 1: the last layer's output included
    assert model.language_model.model.aux_hidden_state_layers == (1, 2, 4)
    with pytest.raises(ValueError, match=r"after layers \[4\] .* the target has 4 decoder layers"):
        model.set_aux_hidden_state_layers((1, 5))
    with pytest.raises(AttributeError, match="NoSuchWithHiddenStates"):
        stand_in_vllm.NoSuchWithHiddenStates  # noqa: B018


def test_variant_refuses_a_decoder_that_does_not_collect_hidden_states(stand_in_vllm):
    model = stand_in_vllm.Qwen2AudioForConditionalGenerationWithHiddenStates(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="does not collect hidden states"):
        model.set_aux_hidden_state_layers((1,))


# --- Against the real vLLM, where it is importable ------------------------------------------------------------------
def _real_vllm():
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install dflash_hf[vllm])")
    from vllm import ModelRegistry
    from vllm.model_executor.models import interfaces

    sys.modules.pop("dflash_hf.serving.vllm_models", None)
    return ModelRegistry, interfaces, importlib.import_module("dflash_hf.serving.vllm_models")


def test_with_vllm_register_replaces_its_classes_by_the_variants():
    registry, interfaces, models = _real_vllm()
    registered = vllm_plugin.register()
    assert FAMILY_ARCHS <= set(registered)
    for arch in registered:
        module, variant = vllm_plugin.HIDDEN_STATE_VARIANTS[arch]
        entry = registry.models[arch]
        assert (entry.module_name, entry.class_name) == ("dflash_hf.serving.vllm_models", variant)
        base = getattr(importlib.import_module(module), arch)
        cls = getattr(models, variant)
        assert not interfaces.supports_eagle3(base) and interfaces.supports_eagle3(cls)
        assert interfaces.supports_multimodal(cls) and cls._processor_factory is base._processor_factory


def test_with_vllm_the_variant_sets_the_decoders_hidden_state_layers():
    _, interfaces, models = _real_vllm()

    class Decoder(nn.Module, interfaces.EagleModelMixin):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Identity() for _ in range(6))

    cls = models.Qwen2AudioForConditionalGenerationWithHiddenStates
    model = cls.__new__(cls)  # vLLM's constructor needs a whole engine configuration
    nn.Module.__init__(model)
    model.language_model = _LanguageModel(Decoder())
    model.get_language_model = lambda: model.language_model
    model.set_aux_hidden_state_layers((3, 1, 6))
    assert model.language_model.model.aux_hidden_state_layers == (1, 3, 6)
    with pytest.raises(ValueError, match="the target has 6 decoder layers"):
        model.set_aux_hidden_state_layers((7,))
    assert torch.is_tensor(torch.zeros(1))  # the environment's torch serves both


def test_with_vllm_its_plugin_loader_finds_and_runs_the_entry_point(tmp_path, monkeypatch):
    registry, interfaces, _ = _real_vllm()
    import vllm.plugins

    # the entry point as an installed dflash_hf declares it (an editable install made before it may lack it)
    info = tmp_path / "dflash_hf_entry_point-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dflash_hf_entry_point\nVersion: 0.0.0\n")
    ref = f"{vllm_plugin.__name__}:{vllm_plugin.register.__name__}"
    (info / "entry_points.txt").write_text(
        f"[{vllm_plugin.ENTRY_POINT_GROUP}]\n{vllm_plugin.ENTRY_POINT_NAME} = {ref}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    for arch in FAMILY_ARCHS:  # vLLM's own classes until the plugin runs
        monkeypatch.setitem(registry.models, arch, registry.models[arch])
        registry.models[arch] = "vllm's own"
    vllm.plugins.load_general_plugins()
    for arch in FAMILY_ARCHS:
        cls = registry.models[arch].load_model_cls()
        assert cls.__name__ == f"{arch}WithHiddenStates" and interfaces.supports_eagle3(cls)
