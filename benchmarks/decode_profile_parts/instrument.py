"""The instrumented decode of `decode_profile.py`: a clock per phase and the package's decode loop wrapped in it."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager

import torch

from dflash_hf.generation import fixed_draft, fixed_verify, speculative, tree_decode, tree_verify

MEASURED = ("prefill", "draft", "proposal", "verify")
HOST_PARTS = ("scores", "accept", "stop", "crop")
PHASES = ("setup", *MEASURED, "host")
# Functions the decode loop of dflash_hf.generation.speculative looks up in its module, timed as host parts
# (`accept_prefix` calls the greedy or the sampling acceptance rule).
HOST_FUNCTIONS = {"processed_scores": "scores", "accept_prefix": "accept", "crop_cache": "crop"}
# The same phases of a tree cycle (`tree_budget`), looked up in dflash_hf.generation.tree_decode: the eager tree's
# build is the proposal, the path's cache rows kept (or cropped) the crop.
TREE_FUNCTIONS = {
    "draft_scores": "proposal",
    "build_tree": "proposal",
    "tree_processed": "scores",
    "accept_greedy": "accept",
    "accept_sampled": "accept",
    "keep_path": "crop",
    "crop_cache": "crop",
}


class PhaseClock:
    """Accumulated seconds per name. Each measurement ends with a device synchronize; on CUDA it is the span
    between two CUDA events recorded around it, on the CPU `time.perf_counter`. Measurements may nest."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def measure(self, name: str):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                end.synchronize()
                self.seconds[name] += start.elapsed_time(end) / 1000.0
        else:
            start = time.perf_counter()
            try:
                yield
            finally:
                self.seconds[name] += time.perf_counter() - start


def timed(clock, name: str, fn):
    """`fn` measured under `name` at every call, by `clock.measure` (a `PhaseClock` or decode_ops' `OpCounter`)."""

    def wrapper(*args, **kwargs):
        with clock.measure(name):
            return fn(*args, **kwargs)

    return wrapper


@contextmanager
def instrumented(draft, clock: PhaseClock):
    """Wrap the draft's forward, `propose_block`, the target's forwards (`TargetVerifier.__call__`: its first call in a
    decode is the prefill), the decode loop (`decode_loop`, with its stop check) and the host parts of
    `dflash_hf.generation.speculative` and of a tree cycle (`dflash_hf.generation.tree_decode`), restoring everything
    afterwards."""
    sp = speculative
    fixed_propose = fixed_draft.FixedDraftStep.propose  # the fixed-shape draft step (a CUDA graph on a GPU)
    fixed_verify_call = fixed_verify.FixedVerifyStep.verify  # the fixed-shape verify (a CUDA graph on a GPU)
    tree_step = tree_verify.FixedTreeVerifyStep  # the same, over a token tree
    fixed_tree_verify = tree_step.verify_tree_inputs
    inside_fixed_step: list[bool] = []  # the draft forward hooks stay quiet inside it (warm-up and capture)
    originals = {name: getattr(sp, name) for name in ("propose_block", "decode_loop", *HOST_FUNCTIONS)}
    tree_originals = {name: getattr(tree_decode, name) for name in TREE_FUNCTIONS}
    verifier_call = sp.TargetVerifier.__call__
    decode = originals["decode_loop"]

    def verifier_timed(self, **kwargs):
        with clock.measure("prefill" if self.forwards == 0 else "verify"):
            return verifier_call(self, **kwargs)

    def decode_timed(*args, first_stop, **kwargs):
        with clock.measure("decode"):
            return decode(*args, first_stop=timed(clock, "stop", first_stop), **kwargs)

    starts: list = []

    def draft_start(_module, _args):
        if inside_fixed_step:
            return
        starts.append(clock.measure("draft"))
        starts[-1].__enter__()

    def draft_end(_module, _args, _output):
        if not inside_fixed_step:
            starts.pop().__exit__(None, None, None)

    def fixed_propose_timed(self, *args, **kwargs):
        inside_fixed_step.append(True)
        try:
            with clock.measure("draft"):
                return fixed_propose(self, *args, **kwargs)
        finally:
            inside_fixed_step.pop()

    with ExitStack() as stack:
        stack.callback(setattr, sp.TargetVerifier, "__call__", verifier_call)
        for name, fn in originals.items():
            stack.callback(setattr, sp, name, fn)
        sp.TargetVerifier.__call__ = verifier_timed
        sp.decode_loop = decode_timed
        sp.propose_block = timed(clock, "proposal", originals["propose_block"])
        for name, part in HOST_FUNCTIONS.items():
            setattr(sp, name, timed(clock, part, originals[name]))
        for name, part in TREE_FUNCTIONS.items():
            stack.callback(setattr, tree_decode, name, tree_originals[name])
            setattr(tree_decode, name, timed(clock, part, tree_originals[name]))
        stack.callback(setattr, fixed_verify.FixedVerifyStep, "verify", fixed_verify_call)
        fixed_verify.FixedVerifyStep.verify = timed(clock, "verify", fixed_verify_call)
        stack.callback(setattr, tree_step, "verify_tree_inputs", fixed_tree_verify)
        tree_step.verify_tree_inputs = timed(clock, "verify", fixed_tree_verify)
        stack.callback(setattr, fixed_draft.FixedDraftStep, "propose", fixed_propose)
        fixed_draft.FixedDraftStep.propose = fixed_propose_timed
        stack.callback(draft.register_forward_pre_hook(draft_start).remove)
        stack.callback(draft.register_forward_hook(draft_end).remove)
        yield


def breakdown(seconds: dict[str, float], cycles: int, tokens: int) -> dict:
    """Phase seconds (the measured ones; `host` and `setup` as what the decode loop and the whole call leave),
    their fractions of the total and ms per cycle."""
    total, decode = seconds["total"], seconds["decode"]
    phases = {name: seconds[name] for name in MEASURED}
    phases["host"] = decode - sum(phases.values())
    phases["setup"] = total - decode
    parts = {name: seconds[name] for name in HOST_PARTS}
    parts["host_other"] = phases["host"] - sum(parts.values())
    return {
        "total_s": total,
        "tokens": tokens,
        "cycles": cycles,
        "tokens_per_s": tokens / max(total, 1e-12),
        "seconds": {name: phases[name] for name in PHASES},
        "fraction": {name: phases[name] / max(total, 1e-12) for name in PHASES},
        "ms_per_cycle": {name: 1000.0 * phases[name] / max(cycles, 1) for name in PHASES},
        "host_parts_seconds": parts,
        "host_parts_ms_per_cycle": {name: 1000.0 * v / max(cycles, 1) for name, v in parts.items()},
    }
