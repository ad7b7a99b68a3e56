"""The operator counter of `decode_ops.py` (its module docstring says what is counted): a `TorchDispatchMode` that
counts dispatched operators, host reads, host tensors and the operators of CUDA-graph regions per stage, loop
iteration and phase."""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_hf.generation import fixed_draft, fixed_verify

REPO = Path(__file__).resolve().parents[2]
_METADATA_OPS = {torch.ops.aten._unsafe_view.default, torch.ops.aten.lift_fresh.default, torch.ops.aten.detach.default}
_SYNC_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


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
_HERE = (str(Path(__file__).resolve()), str(REPO / "benchmarks" / "decode_ops.py"))  # the counter and its script


def _caller() -> str:
    """file:line (function) of the innermost frame outside torch and this script."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename in _HERE):
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
        self.counts: dict[tuple[str, int, str], Counter] = defaultdict(Counter)  # -> ops, reads, host_tensors, ...
        self.in_graph = 0  # inside what a fixed-shape step captures as a CUDA graph (`graph_region`)
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
            if kind == "op" and self.in_graph:
                self.counts[self.stage, self.iteration, phase]["graph_op"] += 1
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
    def graph_region(self):
        """What runs inside is what a CUDA graph captures (its operators are launched by one replay on a GPU)."""
        self.in_graph += 1
        try:
            yield
        finally:
            self.in_graph -= 1

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
        kinds = {"op": "ops", "read": "reads", "host_tensor": "host_tensors", "graph_op": "graph_ops"}
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
        per_iteration = {key: {p: v / n for p, v in table.items()} for key, table in loop.items()}
        per_iteration["outside_graphs"] = {
            p: per_iteration["ops"][p] - per_iteration["graph_ops"][p] for p in (*self.known, "total")
        }
        return {
            "iterations": self.iteration,
            "per_iteration": per_iteration,
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


@contextmanager
def graph_regions(counter: OpCounter):
    """The fixed-shape steps' captured forwards counted as `counter`'s graph regions."""
    captured = ((fixed_draft.FixedDraftStep, "_fixed_step"), (fixed_verify.FixedVerifyStep, "_forward"))
    with ExitStack() as stack:
        for cls, name in captured:
            original = getattr(cls, name)
            stack.callback(setattr, cls, name, original)

            def region(self, *args, _original=original, **kwargs):
                with counter.graph_region():
                    return _original(self, *args, **kwargs)

            setattr(cls, name, region)
        yield
