"""The command-line arguments of `decode_profile.py`."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import HfArgumentParser

from dflash_hf.settings.checks import check_paths_exist
from dflash_hf.settings.decode import DecodeSettings
from dflash_hf.targets.frozen import resolve_dtype
from dflash_hf.targets.processor import check_model_dir

TINY_KINDS = ("text", "whisper")


@dataclass
class ProfileArguments(DecodeSettings):
    """The profile's inputs; `--draft_cuda_graph` / `--verify_cuda_graph` as dflash-eval's (both passes use them)."""

    target: str | None = field(
        default=None, metadata={"help": "The frozen target (model + processor): a Hub id or a local directory."}
    )
    draft: str | None = field(default=None, metadata={"help": "Draft export directory (dflash-train's export)."})
    data: str | None = field(
        default=None,
        metadata={
            "help": "Text targets: JSON lines of prompts ('prompt' or 'messages') or a NeMo manifest (its "
            "--text_field). Speech targets: a NeMo manifest."
        },
    )
    tiny: str | None = field(
        default=None,
        metadata={"help": f"Instead of --target/--draft/--data: a tiny random target and draft, one of {TINY_KINDS}."},
    )
    family: str | None = field(
        default=None,
        metadata={
            "help": "Target family row override (targets.families.registry), e.g. qwen2_audio_single_placeholder."
        },
    )
    prompt: str | None = field(default=None, metadata={"help": "Speech targets: the user text before the audio."})
    num_prompts: int = field(default=8, metadata={"help": "Prompts decoded from the start of --data."})
    max_new_tokens: int = field(default=64, metadata={"help": "Tokens decoded per prompt (both decoders)."})
    precision: str = field(default="fp32", metadata={"help": "Parameter dtype of target and draft: fp32 or bf16."})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N or auto (cuda when available)."})
    text_field: str = field(
        default="text", metadata={"help": "Field of a NeMo manifest line used as a text target's prompt."}
    )
    output_json: str | None = field(
        default=None,
        metadata={
            "help": "Where the results go (default docs/results/decode_profile_<name>_<device>_<precision>.json)."
        },
    )
    progress: bool = field(default=True, metadata={"help": "Show progress bars."})

    def __post_init__(self):
        if self.num_prompts < 1:
            raise ValueError(f"--num_prompts must be >= 1, got {self.num_prompts}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens must be >= 1, got {self.max_new_tokens}")
        resolve_dtype(self.precision)
        super().__post_init__()
        given = [name for name in ("target", "draft", "data") if getattr(self, name) is not None]
        if self.tiny is not None:
            if self.tiny not in TINY_KINDS:
                raise ValueError(f"--tiny must be one of {TINY_KINDS}, got {self.tiny!r}")
            if given:
                raise ValueError(f"--tiny builds its own target, draft and prompts; drop --{', --'.join(given)}")
            return
        missing = sorted({"target", "draft", "data"} - set(given))
        if missing:
            raise ValueError(f"give --{', --'.join(missing)} (or --tiny {'|'.join(TINY_KINDS)} for a smoke run)")
        check_paths_exist(self, ("draft", "data"))
        check_model_dir(self.target, "--target", "the frozen target")


def make_parser() -> HfArgumentParser:
    return HfArgumentParser(ProfileArguments)
