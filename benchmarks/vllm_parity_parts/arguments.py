"""The command-line arguments of `vllm_parity.py`, checked before anything loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from serving_checks import TIE_MARGIN

from dflash_hf.errors import DFlashUserError

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass
class ParityArguments:
    target: str = field(metadata={"help": "The target: a Hub id or a local directory (model and tokenizer/processor)."})
    draft: str = field(metadata={"help": "The draft export directory (dflash-train's export)."})
    prompts: str = field(metadata={"help": "JSON lines of requests (see the module docstring)."})
    out: str = field(default="vllm_parity.json", metadata={"help": "Where the results JSON is written."})
    num_prompts: int = field(default=0, metadata={"help": "Requests from the start of --prompts; 0 = all."})
    max_new_tokens: int = field(default=128, metadata={"help": "Tokens decoded per request (every decoder)."})
    concurrency: list[int] = field(
        default_factory=lambda: [1, 8],
        metadata={"help": "Requests in flight for the throughput rows; parity and the target check use the first."},
    )
    precision: str = field(default="bf16", metadata={"help": "bf16 or fp32, for vLLM and dflash_hf alike."})
    enforce_eager: bool = field(default=True, metadata={"help": "vLLM without CUDA graphs or torch.compile."})
    gpu_memory_utilization: float = field(default=0.8, metadata={"help": "vLLM's share of GPU memory."})
    max_model_len: int = field(default=4096, metadata={"help": "vLLM's longest sequence (prompt + output)."})
    skip_dflash_hf: bool = field(default=False, metadata={"help": "Measure vLLM only (no dflash_hf tau)."})
    target_check: bool = field(
        default=True, metadata={"help": "First compare the target alone in vLLM with transformers' greedy generate."}
    )
    stop_if_target_differs: bool = field(
        default=True,
        metadata={"help": "Stop after the target check when an output differs by more than a near tie."},
    )
    tie_margin: float | None = field(
        default=None,
        metadata={"help": f"transformers' logit margin of a near tie (numerics); default by precision {TIE_MARGIN}."},
    )
    worker: str | None = field(default=None, metadata={"help": "Internal: run one vLLM engine's passes (a JSON file)."})

    def __post_init__(self):
        if self.precision not in DTYPES:
            raise DFlashUserError(f"--precision must be one of {sorted(DTYPES)}, got {self.precision!r}")
        if self.num_prompts < 0:
            raise DFlashUserError(f"--num_prompts must be >= 0 (0 = all), got {self.num_prompts}")
        if self.max_new_tokens < 1:
            raise DFlashUserError(f"--max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise DFlashUserError(f"--concurrency takes positive request counts, got {self.concurrency}")
        self.concurrency = list(dict.fromkeys(self.concurrency))  # each once, in the order given
        if not 0 < self.gpu_memory_utilization <= 1:
            raise DFlashUserError(f"--gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tie_margin is not None and self.tie_margin < 0:
            raise DFlashUserError(f"--tie_margin must be >= 0, got {self.tie_margin}")
        if self.tie_margin is None:
            self.tie_margin = TIE_MARGIN[self.precision]
        if self.worker is None:
            for name in ("draft", "prompts"):
                if not Path(getattr(self, name)).exists():
                    raise DFlashUserError(f"--{name} {getattr(self, name)} does not exist")
            if not (Path(self.draft) / "config.json").is_file():
                raise DFlashUserError(f"--draft {self.draft} has no config.json: give a draft export directory")


def make_parser():
    from transformers import HfArgumentParser

    return HfArgumentParser(ParityArguments)
