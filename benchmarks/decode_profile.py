"""Where a speculative decoding cycle's time goes, and tokens/s against plain greedy `generate`.

    python benchmarks/decode_profile.py --target HuggingFaceTB/SmolLM2-135M-Instruct \
        --draft runs/smollm2-dflash-b8/draft --data prompts.jsonl --num_prompts 4
    python benchmarks/decode_profile.py --target whisper-base/hf --draft runs/whisper-dflash-b8/draft \
        --data data/speech/eval.json --device cuda --precision bf16
    python benchmarks/decode_profile.py --tiny text      # tiny random target and draft (CPU smoke run)

Batch 1, greedy. Two passes over the same prompts:

1. Un-instrumented: `dflash_hf.generation.evaluation.decode_benchmark`, the wall-clock tokens/s of speculative
decoding and of
   the target's own greedy `generate` (same dtype and device, first prompt decoded once untimed), outputs checked
   token-identical.
2. Instrumented: the same speculative decoding with the package's functions wrapped inside this script (nothing
   in the package changes): every phase is timed on its own, with a device synchronize at its end (CUDA events on
   `--device cuda`, `time.perf_counter` on the CPU), so the phases add up to the decode's wall time. Its outputs
   must equal the un-instrumented ones.

Phases of the instrumented pass (summed over prompts, also per cycle):

- `setup`: what `speculative_generate` does before the draft/verify loop (the target's `generate` preparing its
  prompt, processors and stopping criteria; Whisper's encoder).
- `prefill`: the target's forward over the prompt.
- `draft`: the draft's forward over a block. With the draft's step replayed as a CUDA graph (`--draft_cuda_graph`,
  default `auto`: on a GPU), `draft` is the whole replayed step, the proposal included (its first call captures
  it), and `proposal` is zero.
- `proposal`: the draft's tokens from its hidden states (`propose_block`: lm_head and argmax, DFlash2's selector).
- `verify`: the target's forward over a block. With the fixed-shape verify (`--verify_cuda_graph`, default `auto`: a
  CUDA graph on a GPU where it can run), the replayed step (block ids and positions copied in, taps and logits out);
  its capture, on the first block of a shape, falls in `setup`.
- `host`: everything else inside the loop; its measured parts are `scores` (the target's logits processors),
  `accept` (acceptance), `stop` (stop checks) and `crop` (KV cache cropping); `host_other` is the rest (block and
  position tensors, sequence growth, Python).

Text targets read `--data` as JSON lines of `{"prompt": ...}` / `{"messages": [...]}` (as `dflash-eval`), or the
`--text_field` (default `text`) of each line of a NeMo manifest as one user turn (chat template when the tokenizer
has one). Speech targets read a NeMo manifest through the package's data layer, as `dflash-eval` does (audio read
with soundfile, features by the target's processor). Results (with the commit, the command and the device) go to
`docs/results/decode_profile_<name>_<device>_<precision>.json`, and a table is printed.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import HfArgumentParser

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: the checkout's package
    sys.path.insert(0, str(REPO))

from dflash_hf import DFlashConfig, DFlashDraftModel  # noqa: E402
from dflash_hf.data.eval_rows import iter_prompts, speech_rows_and_collator  # noqa: E402
from dflash_hf.data.text_prompts import first_record, json_records  # noqa: E402
from dflash_hf.data.text_prompts import text_prompts as eval_text_prompts  # noqa: E402
from dflash_hf.generation import evaluation, fixed_draft, fixed_verify, speculative  # noqa: E402
from dflash_hf.generation.decode_options import DecodeOptions  # noqa: E402
from dflash_hf.settings.checks import check_paths_exist  # noqa: E402
from dflash_hf.settings.decode import DecodeSettings  # noqa: E402
from dflash_hf.targets.families.base import get_tokenizer  # noqa: E402
from dflash_hf.targets.families.registry import generate_kwargs  # noqa: E402
from dflash_hf.targets.frozen import FrozenTarget, load_target, resolve_dtype  # noqa: E402
from dflash_hf.targets.processor import check_model_dir  # noqa: E402
from dflash_hf.testing import tiny  # noqa: E402

RESULTS_DIR = REPO / "docs" / "results"
SCRIPT_PATH = Path(__file__).resolve()
TINY_KINDS = ("text", "whisper")
TINY_BLOCK = 4
TINY_WHISPER_MASK = 364  # <|0.00|>: a timestamp token, never produced when decoding without timestamps
MEASURED = ("prefill", "draft", "proposal", "verify")
HOST_PARTS = ("scores", "accept", "stop", "crop")
PHASES = ("setup", *MEASURED, "host")
# Functions the decode loop of dflash_hf.generation.speculative looks up in its module, timed as host parts
# (`accept_prefix` calls the greedy or the sampling acceptance rule).
HOST_FUNCTIONS = {"processed_scores": "scores", "accept_prefix": "accept", "crop_cache": "crop"}


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


# ------------------------------------------------------------------------------------------------ timing
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

    def timed(self, name: str, fn):
        """`fn` measured under `name` at every call."""

        def wrapper(*args, **kwargs):
            with self.measure(name):
                return fn(*args, **kwargs)

        return wrapper


@contextmanager
def instrumented(draft, clock: PhaseClock):
    """Wrap the draft's forward, `propose_block`, the target's forwards (`TargetVerifier.__call__`: its first call in a
    decode is the prefill), the decode loop (`decode_loop`, with its stop check) and the host parts of
    `dflash_hf.generation.speculative`, restoring everything afterwards."""
    sp = speculative
    fixed_propose = fixed_draft.FixedDraftStep.propose  # the fixed-shape draft step (a CUDA graph on a GPU)
    fixed_verify_call = fixed_verify.FixedVerifyStep.verify  # the fixed-shape verify (a CUDA graph on a GPU)
    inside_fixed_step: list[bool] = []  # the draft forward hooks stay quiet inside it (warm-up and capture)
    hosts = HOST_FUNCTIONS
    originals = {name: getattr(sp, name) for name in ("propose_block", "decode_loop", *hosts)}
    verifier_call = sp.TargetVerifier.__call__
    decode = originals["decode_loop"]

    def fixed_verify_timed(self, *args, **kwargs):
        with clock.measure("verify"):
            return fixed_verify_call(self, *args, **kwargs)

    def verifier_timed(self, **kwargs):
        with clock.measure("prefill" if self.forwards == 0 else "verify"):
            return verifier_call(self, **kwargs)

    def decode_timed(*args, first_stop, **kwargs):
        with clock.measure("decode"):
            return decode(*args, first_stop=clock.timed("stop", first_stop), **kwargs)

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
        sp.propose_block = clock.timed("proposal", originals["propose_block"])
        for name, part in hosts.items():
            setattr(sp, name, clock.timed(part, originals[name]))
        stack.callback(setattr, fixed_verify.FixedVerifyStep, "verify", fixed_verify_call)
        fixed_verify.FixedVerifyStep.verify = fixed_verify_timed
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


# ------------------------------------------------------------------------------------------------ models and prompts
def _random_draft(ft: FrozenTarget, mask_token_id: int) -> DFlashDraftModel:
    cfg = DFlashConfig.from_target_config(
        ft.text_config, mask_token_id=mask_token_id, num_hidden_layers=1, block_size=TINY_BLOCK
    )
    cfg.vocab_size = ft.vocab_size
    torch.manual_seed(0)
    return DFlashDraftModel(cfg).eval()


def tiny_setup(kind: str, num_prompts: int, workdir: Path):
    """A tiny sharpened random target, a random draft and `num_prompts` prompts of `kind` ("text": random token
    ids; "whisper": synthetic speech through the speech data path)."""
    if kind == "text":
        tok = tiny.build_tokenizer()
        model = tiny.sharpen(tiny.build_text_target(tok, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1))
        ft = FrozenTarget(model)
        draft = _random_draft(ft, tok.convert_tokens_to_ids(tiny.MASK_TOKEN))
        gen = torch.Generator().manual_seed(0)
        prompts = []
        for i in range(num_prompts):
            ids = torch.randint(3, 250, (1, 7 + i), generator=gen)
            prompts.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        return ft, draft, prompts
    model, processor = tiny.build_whisper_target(hidden_size=32, num_heads=2, seed=2)
    ft = FrozenTarget(tiny.sharpen(model, seed=2))
    manifest = tiny.synthesize_speech(workdir / "speech", num_prompts, seed=0)
    prompts = speech_prompts(str(manifest), processor, model.config, num_prompts)
    return ft, _random_draft(ft, TINY_WHISPER_MASK), prompts


def speech_prompts(
    path: str, processor, config, limit: int, family: str | None = None, prompt: str | None = None
) -> list[dict]:
    """Prompts of a NeMo speech manifest as `dflash-eval` renders them (validated cuts, the target's processor)."""
    from dflash_hf.data.conversation import ConversationConfig

    rows, collate = speech_rows_and_collator(
        path, processor, config, family=family, conversation=ConversationConfig(prompt=prompt)
    )
    return list(itertools.islice(iter_prompts(rows, collate), limit))


def text_prompts(path: str, tokenizer, text_field: str, limit: int) -> list[dict]:
    """Prompts of JSON lines (`prompt` / `messages`, read as `dflash-eval` reads them) or of a NeMo manifest's
    `text_field` (one user turn)."""
    record = first_record(path)
    if "prompt" in record or "messages" in record:
        return list(itertools.islice(eval_text_prompts(path, tokenizer), limit))
    prompts = []
    for origin, record in itertools.islice(json_records(path), limit):
        text = record.get(text_field)
        if not isinstance(text, str) or not text:
            raise ValueError(
                f"--data {origin}: no text in field --text_field {text_field!r} (keys {sorted(record)}); "
                "give JSON lines with 'prompt' or 'messages', or name the manifest's text field"
            )
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            enc = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        else:
            enc = tokenizer(text, return_tensors="pt")
        prompts.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return prompts


def real_setup(args: ProfileArguments, device: torch.device):
    from dflash_hf.export.drafts import load_draft_strict
    from dflash_hf.targets.processor import load_processor

    ft = FrozenTarget(load_target(args.target, args.precision).to(device), args.family)
    draft = load_draft_strict(args.draft).to(device=device, dtype=resolve_dtype(args.precision)).eval()
    cfg = draft.config
    ft.validate(mask_token_id=cfg.mask_token_id, target_layer_ids=cfg.target_layer_ids, hidden_size=cfg.hidden_size)
    processor = load_processor(args.target)
    if ft.family.has_audio:
        prompts = speech_prompts(args.data, processor, ft.model.config, args.num_prompts, ft.family.name, args.prompt)
    else:
        prompts = text_prompts(args.data, get_tokenizer(processor), args.text_field, args.num_prompts)
    if not prompts:
        raise ValueError(f"--data {args.data!r} gave no prompt")
    return ft, draft, prompts


# ------------------------------------------------------------------------------------------------ the two passes
@contextmanager
def recorded_sequences(store: list):
    """Record the sequences of every `speculative_generate` call `decode_benchmark` makes."""
    real = evaluation.speculative_generate

    def recorder(*args, **kwargs):
        out = real(*args, **kwargs)
        store.append(out.sequences)
        return out

    evaluation.speculative_generate = recorder
    try:
        yield
    finally:
        evaluation.speculative_generate = real


def profile_pass(
    draft,
    ft: FrozenTarget,
    prompts: list[dict],
    max_new_tokens: int,
    progress: bool,
    options: DecodeOptions | None = None,
):
    """Instrumented speculative decoding of every prompt (`options`: how its steps run): (breakdown, sequences)."""
    clock = PhaseClock(ft.device)
    sequences, cycles, tokens = [], 0, 0
    with instrumented(draft, clock):
        for inputs in tqdm(prompts, disable=not progress, desc="instrumented"):
            n_prompt = inputs["input_ids"].shape[1]
            kwargs = generate_kwargs(
                ft.family, {k: v.to(ft.device) if torch.is_tensor(v) else v for k, v in inputs.items()}
            )
            with clock.measure("total"):
                out = speculative.speculative_generate(
                    draft,
                    ft,
                    max_new_tokens,
                    options=options,
                    **kwargs,
                )
            sequences.append(out.sequences)
            cycles += len(out.acceptance_lengths)
            tokens += out.sequences.shape[1] - n_prompt
    return breakdown(clock.seconds, cycles, tokens), sequences


def run_profile(args: ProfileArguments, command: str) -> dict:
    commit = git_commit()  # before the run: the code that was imported
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            ft, draft, prompts = tiny_setup(args.tiny, args.num_prompts, Path(tmp))
            dtype = resolve_dtype(args.precision)
            ft.model.to(device=device, dtype=dtype)
            draft.to(device=device, dtype=dtype)
        else:
            ft, draft, prompts = real_setup(args, device)
    options = DecodeOptions.from_settings(args)
    prompts = [ft.cast_features(p) for p in prompts]  # audio features in the target's dtype (bf16 encoders refuse fp32)
    reference: list = []
    with recorded_sequences(reference), torch.no_grad():
        stats = evaluation.decode_benchmark(
            draft,
            ft,
            prompts,
            args.max_new_tokens,
            progress=args.progress,
            total=len(prompts),
            options=options,
        )
    reference = reference[-len(prompts) :]  # the warm-up decode of the first prompt comes first
    with torch.no_grad():
        profile, sequences = profile_pass(draft, ft, prompts, args.max_new_tokens, args.progress, options)
    same = [torch.equal(a.cpu(), b.cpu()) for a, b in zip(sequences, reference)]
    wall = stats.as_dict()
    return {
        "name": run_name(args),
        "commit": commit,
        "command": command,
        "device": device_name(device),
        "torch": torch.__version__,
        "precision": args.precision,
        "block_size": draft.config.block_size,
        "draft_class": type(draft).__name__,
        "family": ft.family.name,
        "wall_clock": wall,
        "instrumented": profile,
        "instrumented_outputs_identical": all(same),
        "outputs_identical": all(same) and wall["outputs_identical"],
        "args": asdict(args),
    }


# ------------------------------------------------------------------------------------------------ reporting
def run_name(args: ProfileArguments) -> str:
    mode = "" if args.draft_cuda_graph == "auto" else f"-graph-{args.draft_cuda_graph}"
    mode += "" if args.verify_cuda_graph == "auto" else f"-verify-{args.verify_cuda_graph}"
    if args.tiny:
        return f"tiny-{args.tiny}{mode}"
    draft = Path(args.draft).resolve()
    return (draft.parent.name if draft.name == "draft" else draft.name) + mode


def git_commit() -> str:
    """The checkout's commit (`+dirty` with uncommitted changes); `DFLASH_COMMIT` when set (a copy of the tree
    without its git history, e.g. an offline bundle, names its commit this way)."""
    if os.environ.get("DFLASH_COMMIT"):
        return os.environ["DFLASH_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):  # a copy without .git (the device): what the caller says
        return os.environ.get("DFLASH_COMMIT", "unknown")
    return head + ("+dirty" if dirty else "")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def results_table(results: dict) -> str:
    prof, wall = results["instrumented"], results["wall_clock"]
    lines = [f"{'phase':<12} {'ms/cycle':>10} {'share':>8}"]
    for name in PHASES:
        lines.append(f"{name:<12} {prof['ms_per_cycle'][name]:>10.3f} {100 * prof['fraction'][name]:>7.1f}%")
    for name, ms in prof["host_parts_ms_per_cycle"].items():
        lines.append(f"  {name:<10} {ms:>10.3f}")
    lines += [
        f"instrumented: {prof['tokens']} tokens in {prof['cycles']} cycles, {prof['total_s']:.3f} s, "
        f"{prof['tokens_per_s']:.1f} tokens/s",
        f"wall clock: speculative {wall['spec_tokens_per_s']:.1f} tokens/s, target greedy "
        f"{wall['greedy_tokens_per_s']:.1f} tokens/s, speedup {wall['speedup']:.2f}x, tau {wall['tau']:.3f}",
        f"outputs identical (speculative, instrumented, greedy): {'yes' if results['outputs_identical'] else 'NO'}",
        f"{results['name']} on {results['device']}, {results['precision']}, block {results['block_size']}, "
        f"commit {results['commit']}",
    ]
    return "\n".join(lines)


def command_line(script: Path, argv: list[str] | None) -> str:
    """The command a results JSON records: this process's, or the script's with `argv` (a call from Python)."""
    return shlex.join([sys.executable, *(sys.argv if argv is None else [str(script), *argv])])


def write_results(results: dict, out: Path, table: str) -> None:
    """The results JSON at `out`, then the printed table and where the JSON went."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(table)
    print(f"results written to {out}")


def main(argv: list[str] | None = None) -> dict:
    (args,) = make_parser().parse_args_into_dataclasses(args=argv)
    results = run_profile(args, command_line(SCRIPT_PATH, argv))
    out = (
        Path(args.output_json)
        if args.output_json
        else (
            RESULTS_DIR / f"decode_profile_{results['name']}_{results['device'].split()[0].replace(':', '')}_"
            f"{args.precision}.json"
        )
    )
    write_results(results, out, results_table(results))
    return results


if __name__ == "__main__":
    sys.exit(0 if main()["outputs_identical"] else 1)
