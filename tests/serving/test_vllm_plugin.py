"""The vLLM plugin (of the serving environment, `requirements-serving.txt`): declared as a `vllm.general_plugins`
entry point, registers SupportsEagle3 variants of vLLM's audio LLMs under vLLM's own architecture names, refuses the
targets vLLM's classes would build wrongly (a text model other than the one the class builds, a transformers-saved
Voxtral), and never makes `dflash_hf` import vLLM.

Without vLLM the registration and the variants run against a stand-in of the few vLLM names they use; with vLLM
importable (CI's `serving` stage) the last tests run them against the real one: its plugin loader, `ModelRegistry`
and config hooks."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from torch import nn
from transformers import GlmAsrConfig, Qwen2AudioConfig, VoxtralConfig
from utils import REPO_ROOT, REQUIRE_VLLM, require_vllm

from dflash_hf.serving import vllm_plugin

FAMILY_ARCHS = {"Qwen2AudioForConditionalGeneration", "VoxtralForConditionalGeneration"}


def test_the_entry_point_and_the_extra_are_declared():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    ref = project["entry-points"][vllm_plugin.ENTRY_POINT_GROUP][vllm_plugin.ENTRY_POINT_NAME]
    module, _, function = ref.partition(":")
    assert getattr(importlib.import_module(module), function) is vllm_plugin.register
    assert project["optional-dependencies"]["vllm"] == ["vllm[audio]>=0.34,<0.35"]  # the version measured


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


class _VerifyAndUpdateConfig:
    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return


def _stand_in_registry(monkeypatch, archs, config_map):
    registry = _Registry(archs)
    models = types.ModuleType("vllm.model_executor.models.config")
    models.MODELS_CONFIG_MAP, models.VerifyAndUpdateConfig = config_map, _VerifyAndUpdateConfig
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(ModelRegistry=registry))
    monkeypatch.setitem(sys.modules, "vllm.model_executor", types.ModuleType("vllm.model_executor"))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.models", types.ModuleType("vllm.model_executor.models"))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.models.config", models)
    return registry


def test_register_maps_vllms_audio_llm_architectures_to_the_variants_and_their_checks(monkeypatch):
    calls = []

    class VllmsOwnHook(_VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_model_config(model_config) -> None:
            calls.append(model_config)

    config_map = {"VoxtralForConditionalGeneration": VllmsOwnHook}
    archs = ["Qwen2AudioForConditionalGeneration", "VoxtralForConditionalGeneration", "LlamaForCausalLM"]
    registry = _stand_in_registry(monkeypatch, archs, config_map)
    assert vllm_plugin.register() == ["Qwen2AudioForConditionalGeneration", "VoxtralForConditionalGeneration"]
    checks = dict(config_map)
    assert vllm_plugin.register() == ["Qwen2AudioForConditionalGeneration", "VoxtralForConditionalGeneration"]
    assert config_map == checks  # idempotent: the checks are not stacked
    module = "dflash_hf.serving.vllm_models"
    assert registry.models == {
        "Qwen2AudioForConditionalGeneration": f"{module}:Qwen2AudioForConditionalGenerationWithHiddenStates",
        "VoxtralForConditionalGeneration": f"{module}:VoxtralForConditionalGenerationWithHiddenStates",
        "LlamaForCausalLM": "vllm's own",  # architectures that serve DFlash already are left alone
    }
    assert set(config_map) == {"Qwen2AudioForConditionalGeneration", "VoxtralForConditionalGeneration"}
    llama_inside = types.SimpleNamespace(hf_config=_qwen2_audio_config("llama"))
    with pytest.raises(ValueError, match="dflash_hf: vLLM's Qwen2AudioForConditionalGeneration always builds"):
        config_map["Qwen2AudioForConditionalGeneration"].verify_and_update_model_config(llama_inside)
    config_map["Qwen2AudioForConditionalGeneration"].verify_and_update_model_config(
        types.SimpleNamespace(hf_config=_qwen2_audio_config("qwen2"))
    )
    mistral_format = types.SimpleNamespace(hf_config=_voxtral_config(downsample_factor=4))
    config_map["VoxtralForConditionalGeneration"].verify_and_update_model_config(mistral_format)
    assert calls == [mistral_format]  # vLLM's own hook for the architecture still runs, after the check
    assert FAMILY_ARCHS <= set(vllm_plugin.HIDDEN_STATE_VARIANTS)
    for arch, (module, variant) in vllm_plugin.HIDDEN_STATE_VARIANTS.items():
        assert module.startswith("vllm.model_executor.models.") and variant == f"{arch}WithHiddenStates"


# --- Which targets vLLM's classes build as transformers does ---------------------------------------------------------
def _text(model_type: str) -> dict:
    return dict(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)


def _qwen2_audio_config(text_type: str) -> Qwen2AudioConfig:
    return Qwen2AudioConfig(text_config=_text(text_type))


def _voxtral_config(**audio) -> VoxtralConfig:
    config = VoxtralConfig(text_config=_text("llama"))
    for key, value in audio.items():
        setattr(config.audio_config, key, value)
    return config


@pytest.mark.parametrize(
    ("arch", "config", "refused"),
    [
        ("Qwen2AudioForConditionalGeneration", _qwen2_audio_config("qwen2"), None),
        ("Qwen2AudioForConditionalGeneration", _qwen2_audio_config("llama"), "builds its text model as Qwen2ForCausal"),
        ("AudioFlamingo3ForConditionalGeneration", _qwen2_audio_config("qwen3"), "text model is 'qwen3'"),
        ("GlmAsrForConditionalGeneration", GlmAsrConfig(), None),
        ("GlmAsrForConditionalGeneration", GlmAsrConfig(text_config=_text("qwen2")), "as LlamaForCausalLM"),
        ("VoxtralForConditionalGeneration", _voxtral_config(), "loads Mistral-format checkpoints only"),
        ("VoxtralForConditionalGeneration", _voxtral_config(downsample_factor=4), None),
    ],
)
def test_refusal_names_what_vllms_class_would_build_wrongly(arch, config, refused):
    reason = vllm_plugin.refusal(arch, config)
    if refused is None:
        assert reason is None
        vllm_plugin.check_servable(arch, config)
    else:
        assert refused in reason and "\n" not in reason
        with pytest.raises(ValueError, match=f"^dflash_hf: .*{refused}"):
            vllm_plugin.check_servable(arch, config)


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
    """vLLM's Qwen2-Audio as far as the variant sees it: built from vLLM's config, a language model whose decoder
    collects hidden states (the stand-in's config carries the decoder)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        self.language_model = _LanguageModel(vllm_config.decoder)

    def get_language_model(self):
        return self.language_model

    def load_weights(self, weights):  # vLLM's: the names as they stream in, loaded by module name
        self.loaded = [name for name, _ in weights]
        return set(self.loaded)


def _vllm_config(decoder: nn.Module, text_type: str = "qwen2"):
    model_config = types.SimpleNamespace(hf_config=_qwen2_audio_config(text_type))
    return types.SimpleNamespace(model_config=model_config, decoder=decoder)


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
    model = cls(vllm_config=_vllm_config(_Decoder(num_layers=4)))
    model.set_aux_hidden_state_layers((2, 4, 1))  # DFlash taps [0, 1, 3] + 1: the last layer's output included
    assert model.language_model.model.aux_hidden_state_layers == (1, 2, 4)
    with pytest.raises(ValueError, match=r"after layers \[4\] .* the target has 4 decoder layers"):
        model.set_aux_hidden_state_layers((1, 5))
    with pytest.raises(AttributeError, match="NoSuchWithHiddenStates"):
        stand_in_vllm.NoSuchWithHiddenStates  # noqa: B018
    with pytest.raises(ValueError, match="dflash_hf: .* this target's text model is 'llama'"):
        cls(vllm_config=_vllm_config(_Decoder(num_layers=4), text_type="llama"))


def test_variant_loads_the_layout_transformers_5_17_to_5_22_save_under_vllms_names(stand_in_vllm):
    model = stand_in_vllm.Qwen2AudioForConditionalGenerationWithHiddenStates(vllm_config=_vllm_config(_Decoder(2)))
    saved = ["language_model.model.model.layers.0.mlp.up_proj.weight", "language_model.lm_head.weight"]
    saved += ["language_model.model.model.embed_tokens.weight", "audio_tower.conv1.weight"]
    loaded = model.load_weights((name, torch.zeros(1)) for name in saved)
    assert model.loaded == [
        "language_model.model.layers.0.mlp.up_proj.weight",
        "language_model.lm_head.weight",
        "language_model.model.embed_tokens.weight",
        "audio_tower.conv1.weight",
    ]
    assert loaded == set(model.loaded)


def test_variant_refuses_a_decoder_that_does_not_collect_hidden_states(stand_in_vllm):
    cls = stand_in_vllm.Qwen2AudioForConditionalGenerationWithHiddenStates
    model = cls(vllm_config=_vllm_config(nn.Linear(2, 2)))
    with pytest.raises(RuntimeError, match="does not collect hidden states"):
        model.set_aux_hidden_state_layers((1,))


# --- Against the real vLLM, where it is importable ------------------------------------------------------------------
def _real_vllm():
    require_vllm()
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


def _installed_entry_point() -> bool:
    """Whether the installed dflash_hf declares the plugin's entry point (an editable install made before the entry
    point existed does not; CI's serving stage requires it)."""
    try:
        points = importlib.metadata.distribution("dflash_hf").entry_points
    except importlib.metadata.PackageNotFoundError:
        return False
    ref = f"{vllm_plugin.__name__}:{vllm_plugin.register.__name__}"
    return any(
        (p.group, p.name, p.value) == (vllm_plugin.ENTRY_POINT_GROUP, vllm_plugin.ENTRY_POINT_NAME, ref) for p in points
    )


def test_with_vllm_its_plugin_loader_finds_and_runs_the_entry_point(tmp_path, monkeypatch):
    registry, interfaces, _ = _real_vllm()
    import vllm.plugins

    if os.environ.get(REQUIRE_VLLM) == "1":
        assert _installed_entry_point(), "the installed dflash_hf lacks its vllm.general_plugins entry point"
    if not _installed_entry_point():  # the entry point as an installed dflash_hf declares it
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


@pytest.mark.slow  # vLLM inspects the registered classes in a subprocess (about 40 s the first time)
def test_with_vllm_its_config_refuses_a_target_its_class_would_build_wrongly(tmp_path, monkeypatch):
    """The real ModelConfig of a Qwen2-Audio target, after vLLM's own plugin loader ran the plugin: a Qwen2 text model
    is accepted and resolves to the variant; a Llama one is refused with the plugin's reason before any weight loads."""
    registry, interfaces, _ = _real_vllm()
    import vllm.plugins
    from vllm.config import ModelConfig

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    for text_type in ("qwen2", "llama"):
        config = _qwen2_audio_config(text_type)
        config.architectures = ["Qwen2AudioForConditionalGeneration"]
        config.save_pretrained(tmp_path / text_type)
    accepted = ModelConfig(model=str(tmp_path / "qwen2"), dtype="float32")
    cls, arch = registry.resolve_model_cls(accepted.architectures, accepted)
    assert arch == "Qwen2AudioForConditionalGeneration" and interfaces.supports_eagle3(cls)
    assert cls.__name__ == "Qwen2AudioForConditionalGenerationWithHiddenStates"
    with pytest.raises(ValueError, match="dflash_hf: vLLM's Qwen2AudioForConditionalGeneration always builds"):
        ModelConfig(model=str(tmp_path / "llama"), dtype="float32")


def test_the_serving_environment_file_pins_what_the_package_and_vllm_require(capsys):
    """requirements-serving.txt (written and, in CI's serving stage, checked by resolution against the index with
    scripts/serving_requirements.py): here, offline, that it agrees with pyproject.toml and leaves FlashInfer out."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from utils import loaded_script

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    with loaded_script(REPO_ROOT / "scripts" / "serving_requirements.py") as script:
        lock = script.read_lock()
        pins = {name: version for name, (version, _) in lock.items()}
        assert pins["vllm"] == script.SERVING_PINS["vllm"] and pins["torch"] == "2.14.0"
        assert pins["transformers"] == "5.22.2"  # vLLM 0.34 requires <5.23
        extra = Requirement(project["optional-dependencies"]["vllm"][0])
        assert extra.specifier.contains(pins["vllm"]) and "audio" in extra.extras
        for line in project["dependencies"]:
            req = Requirement(line)
            assert req.specifier.contains(pins[script.canonical(req.name)]), line
        assert "flashinfer-python" not in pins and set(script.UNAVAILABLE) == {"flashinfer-python"}
        assert {"av", "soundfile", "soxr", "scipy", "torchvision"} <= set(pins)  # vLLM's audio extra; Qwen3-ASR's
        script.main(["pins", "vllm", "transformers"])
    assert capsys.readouterr().out.split() == ["vllm==0.34.0", "transformers==5.22.2"]
