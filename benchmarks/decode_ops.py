"""Operators and host reads per speculative cycle and per greedy step: the CPU proxy for GPU kernel launches.

    python benchmarks/decode_ops.py --target openai/whisper-base --data eval.json \
        --num_prompts 3
    python benchmarks/decode_ops.py --tiny text       # tiny random text target
    python benchmarks/decode_ops.py --tiny whisper    # tiny random Whisper (CPU smoke run)
    python benchmarks/decode_ops.py --tiny whisper --fixed_steps --tree_budget 32   # token trees, both steps fixed

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
- **graph operators** (`--fixed_steps`): the operators of what the fixed-shape steps capture as CUDA graphs on a GPU
  (`FixedDraftStep._fixed_step`, `FixedVerifyStep._forward`; on the CPU they run eagerly, as here); a cycle's
  operators less these are the ones launched outside the graphs (`outside graphs`).

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

import sys
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser, LogitsProcessorList, StoppingCriteriaList

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: the checkout's package
    sys.path.insert(0, str(REPO))

from dflash_hf import DFlashConfig  # noqa: E402
from dflash_hf.generation import speculative  # noqa: E402
from dflash_hf.generation.decode_options import DecodeOptions  # noqa: E402
from dflash_hf.generation.target_generate import target_generate  # noqa: E402
from dflash_hf.generation.tree_decode import check_tree_budget  # noqa: E402
from dflash_hf.targets.builder import draft_class_for, init_encoder_context  # noqa: E402
from dflash_hf.targets.families.registry import generate_kwargs  # noqa: E402
from dflash_hf.targets.frozen import FrozenTarget, load_target  # noqa: E402
from dflash_hf.testing import tiny  # noqa: E402

if str(Path(__file__).resolve().parent) not in sys.path:  # imported from elsewhere (tests): decode_profile's parts
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile_parts.inputs import TINY_WHISPER_MASK, speech_prompts, text_prompts, tiny_setup  # noqa: E402
from decode_profile_parts.instrument import instrumented, timed  # noqa: E402
from decode_profile_parts.op_count import OpCounter, counting, graph_regions  # noqa: E402
from decode_profile_parts.record import command_line, device_name, git_commit, write_results  # noqa: E402
from quality_steps.configs import WHISPER_MASK_ID as WHISPER_MASK  # noqa: E402  real_targets.py's Whisper drafts

RESULTS_DIR = REPO / "docs" / "results"
SCRIPT_PATH = Path(__file__).resolve()
TINY_KINDS = ("text", "whisper")
SPEC_PHASES = ("draft", "proposal", "verify", "scores", "accept", "stop", "crop", "other")
GREEDY_PHASES = ("forward", "scores", "stop", "other")


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
    tree_budget: int | None = field(
        default=None,
        metadata={
            "help": "Verify token trees of this many nodes a cycle (speculative_generate's tree_budget) instead of "
            "the chain; on a target whose decoder can take a tree's mask (SDPA or eager attention)."
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
        check_tree_budget(self.tree_budget)


def make_parser() -> HfArgumentParser:
    return HfArgumentParser(OpsArguments)


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
    draft,
    ft: FrozenTarget,
    prompts: list[dict],
    max_new_tokens: int,
    fixed_steps: bool = False,
    tree_budget: int | None = None,
) -> tuple[dict, list]:
    """`speculative_generate`: counts per cycle (a cycle starts at a draft forward). `fixed_steps`: the fixed-shape
    draft step and verify (False: the package's default on the CPU, the eager draft and the growing cache);
    `tree_budget`: token trees of that many nodes verified instead of the chain."""
    counter = OpCounter(starts="draft", ends="decode", phases=SPEC_PHASES)
    accepted, sequences = [], []
    with instrumented(draft, counter), counting(counter), graph_regions(counter):
        for inputs in prompts:
            counter.new_prompt()
            out = speculative.speculative_generate(
                draft,
                ft,
                max_new_tokens,
                options=DecodeOptions(
                    draft_cuda_graph=fixed_steps or None, verify_cuda_graph=fixed_steps or None, tree_budget=tree_budget
                ),
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
    name += f"-tree{args.tree_budget}" if args.tree_budget is not None else ""
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
        spec, sequences = count_speculative(draft, ft, prompts, args.max_new_tokens, args.fixed_steps, args.tree_budget)
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
        if per["graph_ops"]["total"]:
            extra = f"; outside graphs {per['outside_graphs']['total']:.1f}" + extra
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
