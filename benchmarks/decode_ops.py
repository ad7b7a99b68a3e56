"""Operators and host reads per speculative cycle and per greedy step: the CPU proxy for GPU kernel launches.

    python benchmarks/decode_ops.py --target openai/whisper-base --data eval.json \
        --num_prompts 3
    python benchmarks/decode_ops.py --tiny text       # tiny random text target
    python benchmarks/decode_ops.py --tiny whisper    # tiny random Whisper (CPU smoke run)

At batch 1 a small target on a GPU is launch bound: a decoding step costs about what its dispatched operators and
its device-to-host reads cost, not its arithmetic. Those counts do not depend on the device, so they are measured
here on the CPU, exactly (they are deterministic for given weights and inputs):

- **operators**: every aten operator dispatched (a `TorchDispatchMode`), except views and other metadata-only ops
  (`OpOverload.is_view`, `_unsafe_view`, `lift_fresh`, `detach`), which launch no kernel. Allocations
  (`empty`, ...) are counted: they are dispatcher and allocator work on the host. Composite ops appear as the
  kernels the CPU backend runs (e.g. SDPA's CPU flash kernel), so the counts are a proxy, not a GPU trace.
- **host reads** (device-to-host, each a stream synchronize on a GPU): `.item()`/`int()`/`bool()` of a tensor,
  ops with data-dependent output (`nonzero`, `equal`, ...), and `Tensor.tolist()`.
- **host tensors** (host-to-device copies on a GPU): tensors made from Python data (`torch.tensor`).

Per prompt, two decodes of the same target inputs at batch 1, greedy:

1. The target's own `generate(do_sample=False)`. A step is one decoder forward and what follows it (logits
   processors, stopping criteria, the rest of `generate`'s loop) until the next forward. Reported: the mean over
   steps 2.. (`greedy_step`; step 1 is the prompt's forward) and the prefill step. Phases: `forward`, `scores`
   (`LogitsProcessorList`), `stop` (`StoppingCriteriaList`), `other`.
2. `speculative_generate` with each draft, wrapped as `benchmarks/decode_profile.py` wraps it (`instrumented` of
   `decode_profile_parts/instrument.py`, with an operator counter in place of its clock). A cycle runs from one
   draft forward to the next. Phases: `draft` (draft forward), `proposal` (`propose_block`), `verify` (target
   forward), `scores` (logits processors), `accept`, `stop`, `crop` (cache crop), `other` (the rest of the loop).
   The prefill (prompt forward and the first token) is reported apart.

`setup` (before the first decoder forward: `generate`'s preparation, Whisper's encoder) is counted once per prompt
and reported per prompt. Drafts are random (DFlash and DFlash2, `--num_draft_layers`, `--block_size`; with encoder
context on encoder-decoder targets): counts per cycle do not depend on the weights, only tau does. Results (with
the commit and the command) go to `docs/results/decode_ops_<name>_cpu.json` and a table is printed.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from collections import Counter, defaultdict
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import HfArgumentParser, LogitsProcessorList, StoppingCriteriaList

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: the checkout's package
    sys.path.insert(0, str(REPO))

from dflash_hf import DFlashConfig  # noqa: E402
from dflash_hf.generation import speculative  # noqa: E402
from dflash_hf.generation.decode_options import DecodeOptions  # noqa: E402
from dflash_hf.generation.target_generate import target_generate  # noqa: E402
from dflash_hf.targets.builder import draft_class_for, init_encoder_context  # noqa: E402
from dflash_hf.targets.families.registry import generate_kwargs  # noqa: E402
from dflash_hf.targets.frozen import FrozenTarget, load_target  # noqa: E402
from dflash_hf.testing import tiny  # noqa: E402

if str(Path(__file__).resolve().parent) not in sys.path:  # imported from elsewhere (tests): decode_profile's parts
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile_parts.inputs import TINY_WHISPER_MASK, speech_prompts, text_prompts, tiny_setup  # noqa: E402
from decode_profile_parts.instrument import instrumented, timed  # noqa: E402
from decode_profile_parts.record import command_line, device_name, git_commit, write_results  # noqa: E402

RESULTS_DIR = REPO / "docs" / "results"
SCRIPT_PATH = Path(__file__).resolve()
TINY_KINDS = ("text", "whisper")
WHISPER_MASK = importlib.import_module("quality_steps.configs").WHISPER_MASK_ID  # real_targets.py's Whisper drafts
SPEC_PHASES = ("draft", "proposal", "verify", "scores", "accept", "stop", "crop", "other")
GREEDY_PHASES = ("forward", "scores", "stop", "other")
_METADATA_OPS = {torch.ops.aten._unsafe_view.default, torch.ops.aten.lift_fresh.default, torch.ops.aten.detach.default}
_SYNC_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


@dataclass
class OpsArguments:
    target: str | None = field(
        default=None, metadata={"help": "The target (model + processor): a Hub id or a local directory."}
    )
    data: str | None = field(
        default=None,
        metadata={
            "help": "Speech targets: a NeMo manifest; text targets: JSON lines of prompts (as decode_profile.py)."
        },
    )
    tiny: str | None = field(default=None, metadata={"help": f"Instead of --target/--data: one of {TINY_KINDS}."})
    num_prompts: int = field(default=3, metadata={"help": "Prompts decoded from the start of --data."})
    max_new_tokens: int = field(default=24, metadata={"help": "Tokens decoded per prompt (both decoders)."})
    block_size: int = field(default=8, metadata={"help": "Block size of the random drafts."})
    num_draft_layers: int = field(default=2, metadata={"help": "Layers of the random drafts."})
    variants: str = field(default="dflash,dflash2", metadata={"help": "Draft variants, comma separated."})
    mask_token_id: int | None = field(
        default=None, metadata={"help": "Draft mask id (default: 50360 for a real Whisper, the tiny targets' own)."}
    )
    output_json: str | None = field(default=None, metadata={"help": "Default docs/results/decode_ops_<name>_cpu.json."})
    fixed_steps: bool = field(
        default=False,
        metadata={
            "help": "Decode with the fixed-shape draft step and verify (draft_cuda_graph and verify_cuda_graph on): "
            "on a GPU each is one CUDA graph replay, so what the cycle counts outside `draft` and `verify` is the "
            "host work left per cycle."
        },
    )

    def __post_init__(self):
        if (self.tiny is None) == (self.target is None):
            raise ValueError("give --target (and --data) or --tiny")
        if self.tiny is not None and self.tiny not in TINY_KINDS:
            raise ValueError(f"--tiny must be one of {TINY_KINDS}, got {self.tiny!r}")
        if self.target is not None and self.data is None:
            raise ValueError("--target needs --data")
        if self.num_prompts < 1 or self.max_new_tokens < 2:
            raise ValueError("--num_prompts must be >= 1 and --max_new_tokens >= 2")


def make_parser() -> HfArgumentParser:
    return HfArgumentParser(OpsArguments)


# ------------------------------------------------------------------------------------------------ counting
def _kind(func, args) -> str | None:
    """What one dispatched operator is: "op", "read" (device-to-host), "host_tensor" or None (metadata only).
    Indexing is a read only with a boolean index (its nonzero); integer indexing is a gather."""
    if func is torch.ops.aten.lift_fresh.default:
        return "host_tensor"
    if func is torch.ops.aten.index.Tensor:
        boolean = any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in args[1])
        return "read" if boolean else "op"
    if any(tag in func.tags for tag in _SYNC_TAGS):
        return "read"
    if func.is_view or func in _METADATA_OPS:
        return None
    return "op"


_TORCH_DIR = str(Path(torch.__file__).parent)
_HERE = str(SCRIPT_PATH)


def _caller() -> str:
    """file:line (function) of the innermost frame outside torch and this script."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == _HERE):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    for root in (str(REPO) + "/", str(Path(sys.modules["transformers"].__file__).parents[1]) + "/"):
        path = path.removeprefix(root)
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


class OpCounter(TorchDispatchMode):
    """Counts dispatched operators, host reads and host tensors per (stage, iteration, phase). The stage is
    "setup" (before a prompt's first decoder forward), "prefill" (from it to the first step/cycle) or "loop";
    `next_iteration()` starts a step or cycle of the loop. `measure(name)` sets the phase of what runs inside it
    (innermost wins); it is the interface of decode_profile's `PhaseClock`, so decode_profile's `instrumented`
    drives it. `starts` names the phase whose entry starts an iteration, `ends` the one whose exit
    ends the loop."""

    def __init__(self, starts: str, ends: str, phases: tuple[str, ...]):
        super().__init__()
        self.starts, self.ends, self.known = starts, ends, phases
        self.phases: list[str] = []
        self.stage, self.iteration, self.prompts = "setup", 0, 0
        self.counts: dict[tuple[str, int, str], Counter] = defaultdict(Counter)  # -> ops, reads, host_tensors
        self.ops: dict[str, Counter] = defaultdict(Counter)  # loop phase -> op name -> count
        self.read_sites: Counter = Counter()  # "phase: op at file:line" of the loop's host reads and host tensors

    def new_prompt(self) -> None:
        self.stage = "setup"
        self.prompts += 1

    def next_iteration(self) -> None:
        self.stage = "loop"
        self.iteration += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = _kind(func, args)
        if kind is not None:
            phase = self.phase
            self.counts[self.stage, self.iteration, phase][kind] += 1
            if kind == "op" and self.stage == "loop":
                self.ops[phase][str(func)] += 1
            elif kind != "op" and self.stage == "loop":
                self.read_sites[f"{phase}: {func} at {_caller()}"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def phase(self) -> str:
        """The innermost measured phase, `other` for one not in the reported phases."""
        phase = self.phases[-1] if self.phases else "other"
        return phase if phase in self.known else "other"

    def count_tolist(self) -> None:
        phase = self.phase
        self.counts[self.stage, self.iteration, phase]["read"] += 1
        if self.stage == "loop":
            self.read_sites[f"{phase}: tolist at {_caller()}"] += 1

    @contextmanager
    def measure(self, name: str):
        if name == self.starts:
            self.next_iteration()
        elif name == "prefill":
            self.stage = "prefill"
        self.phases.append(name)
        try:
            yield
        finally:
            self.phases.pop()
            if name == self.ends:  # what follows the loop (generate's epilogue) is setup work
                self.stage = "setup"

    def summary(self) -> dict:
        """Per loop iteration: mean counts by phase (`other` for unlisted ones) and the min/max operator total;
        per prompt: the setup and prefill totals."""
        kinds = {"op": "ops", "read": "reads", "host_tensor": "host_tensors"}
        loop = {key: dict.fromkeys((*self.known, "total"), 0) for key in kinds.values()}
        once = {stage: dict.fromkeys(kinds.values(), 0) for stage in ("setup", "prefill")}
        totals: Counter = Counter()
        for (stage, it, phase), counts in self.counts.items():
            for kind, key in kinds.items():
                if stage == "loop":
                    loop[key][phase] += counts[kind]
                    loop[key]["total"] += counts[kind]
                else:
                    once[stage][key] += counts[kind]
            if stage == "loop":
                totals[it] += counts["op"]
        n, prompts = max(self.iteration, 1), max(self.prompts, 1)
        return {
            "iterations": self.iteration,
            "per_iteration": {key: {p: v / n for p, v in table.items()} for key, table in loop.items()},
            "ops_per_iteration_min_max": [min(totals.values(), default=0), max(totals.values(), default=0)],
            "per_prompt": {stage: {k: v / prompts for k, v in t.items()} for stage, t in once.items()},
            "top_ops": {p: dict(c.most_common(15)) for p, c in sorted(self.ops.items())},
            "read_sites_per_iteration": {k: v / n for k, v in self.read_sites.most_common()},
        }


@contextmanager
def counting(counter: OpCounter):
    """`counter` active, with `Tensor.tolist` counted as a host read."""
    tolist = torch.Tensor.tolist

    def counted(self):
        counter.count_tolist()
        return tolist(self)

    torch.Tensor.tolist = counted
    try:
        with counter:
            yield
    finally:
        torch.Tensor.tolist = tolist


# ------------------------------------------------------------------------------------------------ the two decodes
def count_greedy(ft: FrozenTarget, prompts: list[dict], max_new_tokens: int) -> tuple[dict, list]:
    """The target's own greedy `generate`: counts per step (a step starts at a decoder forward, the first is the
    prefill)."""
    counter = OpCounter(starts="step", ends="sample", phases=GREEDY_PHASES)
    forwards = [0]

    def forward_start(*_):
        forwards[0] += 1
        if forwards[0] == 1:
            counter.stage = "prefill"
        else:
            counter.next_iteration()
        counter.phases.append("forward")

    def forward_end(*_):
        counter.phases.pop()

    sequences = []
    with ExitStack() as stack:
        stack.callback(ft.model.register_forward_pre_hook(forward_start).remove)
        stack.callback(ft.model.register_forward_hook(forward_end).remove)
        for cls, phase in ((LogitsProcessorList, "scores"), (StoppingCriteriaList, "stop")):
            stack.callback(setattr, cls, "__call__", cls.__call__)
            cls.__call__ = timed(counter, phase, cls.__call__)
        sample = ft.model._sample  # generate's decoding loop (greedy and sampling)
        stack.callback(delattr, ft.model, "_sample")
        ft.model._sample = timed(counter, "sample", sample)
        with counting(counter):
            for inputs in prompts:
                counter.new_prompt()
                forwards[0] = 0
                sequences.append(target_generate(ft, inputs, max_new_tokens))
    return counter.summary(), sequences


def count_speculative(
    draft, ft: FrozenTarget, prompts: list[dict], max_new_tokens: int, fixed_steps: bool = False
) -> tuple[dict, list]:
    """`speculative_generate`: counts per cycle (a cycle starts at a draft forward). `fixed_steps`: the fixed-shape
    draft step and verify (False: the package's default on the CPU, the eager draft and the growing cache)."""
    counter = OpCounter(starts="draft", ends="decode", phases=SPEC_PHASES)
    accepted, sequences = [], []
    with instrumented(draft, counter), counting(counter):
        for inputs in prompts:
            counter.new_prompt()
            out = speculative.speculative_generate(
                draft,
                ft,
                max_new_tokens,
                options=DecodeOptions(draft_cuda_graph=fixed_steps or None, verify_cuda_graph=fixed_steps or None),
                **inputs,
            )
            sequences.append(out.sequences)
            accepted += out.acceptance_lengths
    summary = counter.summary()
    summary["tau"] = sum(accepted) / max(len(accepted), 1)
    summary["tokens"] = sum(accepted)  # the cycles' tokens (the prefill gives the first)
    return summary, sequences


# ------------------------------------------------------------------------------------------------ models and prompts
def random_draft(ft: FrozenTarget, variant: str, mask_token_id: int, num_layers: int, block_size: int):
    """A random draft of `variant`, with encoder context (initialized from the target's cross-attention) on an
    encoder-decoder target."""
    encoder = ft.encoder_hidden_size if ft.is_encoder_decoder else None
    cfg = DFlashConfig.from_target_config(
        ft.text_config,
        mask_token_id=mask_token_id,
        variant=variant,
        num_hidden_layers=num_layers,
        block_size=block_size,
        encoder_hidden_size=encoder,
    )
    cfg.vocab_size = ft.vocab_size
    torch.manual_seed(0)
    draft = draft_class_for(cfg)(cfg).eval()
    if encoder is not None:
        init_encoder_context(draft, ft)
    return draft


def setup(args: OpsArguments, workdir: Path) -> tuple[FrozenTarget, list[dict], int, str]:
    """(target, generate keywords per prompt, mask id, run name)."""
    if args.tiny == "text":
        ft, _, prompts = tiny_setup("text", args.num_prompts, workdir)
        mask = tiny.build_tokenizer().convert_tokens_to_ids(tiny.MASK_TOKEN)
        name = "tiny-text"
    elif args.tiny == "whisper":
        ft, _, prompts = tiny_setup("whisper", args.num_prompts, workdir)
        mask, name = TINY_WHISPER_MASK, "tiny-whisper"
    else:
        from dflash_hf.targets.families.base import get_tokenizer
        from dflash_hf.targets.processor import load_processor

        ft = FrozenTarget(load_target(args.target, "fp32"))
        processor = load_processor(args.target)
        if ft.family.has_audio:
            prompts = speech_prompts(args.data, processor, ft.model.config, args.num_prompts, ft.family.name)
        else:
            prompts = text_prompts(args.data, get_tokenizer(processor), "text", args.num_prompts)
        mask = WHISPER_MASK if ft.family.name == "whisper" else None
        path = Path(args.target).expanduser()
        name = path.resolve().name if path.is_dir() else args.target.replace("/", "--")  # a directory or a Hub id
        name = path.resolve().parent.name if name == "hf" else name
    mask = args.mask_token_id if args.mask_token_id is not None else mask
    if mask is None:
        raise ValueError("give --mask_token_id for this target")
    return ft, [generate_kwargs(ft.family, ft.cast_features(p)) for p in prompts], mask, name


@torch.no_grad()
def run(args: OpsArguments, command: str) -> dict:
    commit = git_commit()
    with tempfile.TemporaryDirectory() as tmp:
        ft, prompts, mask, name = setup(args, Path(tmp))
    name += "-fixed-steps" if args.fixed_steps else ""
    greedy, reference = count_greedy(ft, prompts, args.max_new_tokens)
    results = {
        "name": name,
        "commit": commit,
        "command": command,
        "device": device_name(torch.device("cpu")),
        "torch": torch.__version__,
        "family": ft.family.name,
        "prompts": len(prompts),
        "greedy_step": greedy,
        "speculative": {},
        "args": asdict(args),
    }
    for variant in args.variants.split(","):
        draft = random_draft(ft, variant, mask, args.num_draft_layers, args.block_size)
        spec, sequences = count_speculative(draft, ft, prompts, args.max_new_tokens, args.fixed_steps)
        spec["outputs_identical"] = all(torch.equal(a, b) for a, b in zip(sequences, reference))
        spec["draft"] = {
            "class": type(draft).__name__,
            "layers": args.num_draft_layers,
            "block_size": args.block_size,
            "encoder_context": draft.config.encoder_context,
        }
        results["speculative"][variant] = spec
    return results


# ------------------------------------------------------------------------------------------------ reporting
def results_table(results: dict) -> str:
    lines = [f"{results['name']} ({results['family']}), {results['prompts']} prompts, commit {results['commit']}"]
    rows = [("greedy step", results["greedy_step"], GREEDY_PHASES)]
    rows += [(f"{v} cycle", s, SPEC_PHASES) for v, s in results["speculative"].items()]
    for label, summary, phases in rows:
        per = summary["per_iteration"]
        ops = ", ".join(f"{p} {per['ops'][p]:.1f}" for p in phases)
        extra = f", tau {summary['tau']:.2f}, identical {summary['outputs_identical']}" if "tau" in summary else ""
        lines.append(
            f"{label:<16} ops {per['ops']['total']:.1f} ({ops}); host reads {per['reads']['total']:.2f}, "
            f"host tensors {per['host_tensors']['total']:.2f}; n={summary['iterations']}{extra}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    (args,) = make_parser().parse_args_into_dataclasses(args=argv)
    results = run(args, command_line(SCRIPT_PATH, argv))
    out = Path(args.output_json) if args.output_json else RESULTS_DIR / f"decode_ops_{results['name']}_cpu.json"
    write_results(results, out, results_table(results))
    return results


if __name__ == "__main__":
    sys.exit(0 if all(s["outputs_identical"] for s in main()["speculative"].values()) else 1)
