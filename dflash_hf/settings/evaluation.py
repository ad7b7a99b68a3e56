"""The options of `dflash-eval` (`EvalSettings`): the draft export, the target and the prompts it is evaluated on,
how many tokens each prompt decodes, where the results go, and the decoding switches (`DecodeSettings`). The checks
of the files they name are `dflash_hf.export.evaluation_setup.check_evaluation_inputs` (run before anything loads).
Light: no torch, no transformers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from dflash_hf.settings.checks import Range, count
from dflash_hf.settings.data import DataSettings
from dflash_hf.settings.decode import DecodeSettings
from dflash_hf.settings.draft import ModelSettings, check_precision


@dataclass
class EvalSettings(DecodeSettings):
    """The options of `dflash-eval` (the decoding switches are `DecodeSettings`')."""

    RANGES: ClassVar[dict[str, Range]] = {"max_new_tokens": count(1), "num_samples": count(0, " (0 = all)")}

    draft: str = field(metadata={"help": "Draft export directory (dflash-train's export or save_pretrained)."})
    target: str = field(
        metadata={"help": "The frozen target (model + processor or tokenizer): a local directory or a Hub id."}
    )
    data: str = field(
        metadata={"help": "NeMo manifest / lhotse cuts file, or JSON lines of text prompts ('prompt' or 'messages')."}
    )
    output_json: str | None = field(
        default=None,
        metadata={
            "help": "Where the results JSON is written; default: beside the draft, <draft>/eval_<data name>.json "
            "(e.g. runs/x/draft/eval_dev.json for --data dev.jsonl). An existing file is refused unless "
            "--overwrite_output_json true."
        },
    )
    overwrite_output_json: bool = field(
        default=False, metadata={"help": "Replace an existing results file (default: refuse it before decoding)."}
    )
    max_new_tokens: int = field(default=128, metadata={"help": "Tokens decoded per prompt (both decoders)."})
    num_samples: int = field(default=0, metadata={"help": "Prompts to decode from the start of --data; 0 = all."})
    precision: str = field(
        default=ModelSettings.precision, metadata={"help": "Parameter dtype of target and draft: fp32 or bf16."}
    )
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N or auto (cuda when available)."})
    family: str | None = field(
        default=None,
        metadata={
            "help": "Target family row (dflash_hf.targets.families.registry); default: the one the draft was "
            "trained with (recorded in its export), else from the target's config."
        },
    )
    prompt: str | None = field(
        default=None,
        metadata={
            "help": "Default user text of manifest conversations; default: the training run's, recorded in the "
            "draft export. An empty string decodes without one."
        },
    )
    system_prompt: str | None = field(
        default=None,
        metadata={
            "help": "System turn of manifest conversations; default: the training run's, recorded in the draft "
            "export. An empty string decodes without one."
        },
    )
    allow_command_audio_sources: bool = field(
        default=DataSettings.allow_command_audio_sources,
        metadata={
            "help": "Let programs read audio: lhotse cuts of type 'command', and decoders (ffmpeg through audioread) "
            "for files libsndfile cannot read. Only for data you trust (default: such a row is an error)."
        },
    )
    allow_mismatch: bool = field(
        default=False,
        metadata={"help": "Exit 0 even if speculative and greedy outputs differ (expected only from bf16 noise)."},
    )
    tree_budget: list[int] = field(
        default_factory=list,
        metadata={
            "help": "Also decode every prompt with tree verification of these node budgets (e.g. 8 16 32 64), "
            "beside the chain on the same prompts in the same run: tau, tokens/s, target forwards and output "
            "identity of each, under 'tree' in the JSON (dflash_hf.generation.tree_decode)."
        },
    )
    allow_target_mismatch: bool = field(
        default=False,
        metadata={
            "help": "Evaluate a draft against a target other than the one it was trained for (another vocabulary, "
            "or weights other than those its export's run record names); refused without it. The differences are "
            "recorded in the results (target_check)."
        },
    )

    def __post_init__(self):
        bad_budgets = [b for b in self.tree_budget if b < 1]
        if bad_budgets or len(set(self.tree_budget)) != len(self.tree_budget):
            raise ValueError(
                f"--tree_budget takes distinct node budgets >= 1 (e.g. 8 16 32 64), got {list(self.tree_budget)}"
            )
        check_precision(self.precision)
        super().__post_init__()


__all__ = ["EvalSettings"]
