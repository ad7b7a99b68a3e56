"""Shared helpers for tests: tiny targets and hand-built batches (no downloads)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import Dataset

from dflash_hf import DFlashConfig, DFlashDraftModel, DFlashTrainer, DFlashTrainingArguments, speculative_generate
from dflash_hf.objective.blocks import doc_ids_from, leading_padding, move_leading_padding
from dflash_hf.serving.checkpoint_layout import DOUBLED_PREFIX, VLLM_PREFIX
from dflash_hf.targets.frozen import FrozenTarget
from dflash_hf.testing import tiny

TESTS_DIR = Path(__file__).resolve().parent
"""`tests/`: the shared helpers and the scripts that tests launch (`dist_train.py`)."""
REPO_ROOT = TESTS_DIR.parent
"""The repository checkout (examples, scripts, README and CI files are read from it)."""
REQUIRE_VLLM = "DFLASH_REQUIRE_VLLM"
"""Set to 1 (CI's `serving` stage) to make the tests against the real vLLM fail, not skip, where it does not import."""


def require_vllm():
    """The `vllm` module, or a skip where it is not installed (a failure under `DFLASH_REQUIRE_VLLM=1`)."""
    if os.environ.get(REQUIRE_VLLM) == "1":
        import vllm

        return vllm
    import pytest

    return pytest.importorskip("vllm", reason="vLLM is not installed (README: serving environment)")


@contextmanager
def loaded_script(path: Path) -> Iterator:
    """A script of the repository (benchmarks/, scripts/) imported as a module under its file name, registered in
    `sys.modules` while in use (a dataclass in it resolves its annotations through its module)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def script_fixture(path: Path):
    """A module-scoped pytest fixture yielding the script at `path` imported with `loaded_script`."""
    import pytest

    @pytest.fixture(scope="module")
    def fixture():
        with loaded_script(path) as module:
            yield module

    return fixture


def doubled_name(name: str) -> str:
    """`name` (a weight name in the layout vLLM reads) in the layout transformers 5.17 to 5.22 save: the language
    model's prefix doubled."""
    if name.startswith(VLLM_PREFIX) and not name.startswith(DOUBLED_PREFIX):
        return DOUBLED_PREFIX + name[len(VLLM_PREFIX) :]
    return name


def raising(calls: list, error: BaseException):
    """A stand-in that records each call in `calls` and raises `error` (a step that fails to build)."""

    def fail(*args, **kwargs):
        calls.append(1)
        raise error

    return fail


def tiny_qwen3_asr_prompt():
    """The sharpened tiny Qwen3-ASR target, its processor, and one audio prompt's inputs as its processor gives them."""
    asr, processor = tiny.build_qwen3_asr_target(
        tiny.build_tokenizer(), hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1
    )
    tiny.sharpen(asr)
    conv = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Transcribe."}]}]
    rendered = processor.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    inputs = processor(
        text=[rendered], audio=[np.zeros(16000, np.float32) + 0.05], sampling_rate=16000, return_tensors="pt"
    )
    return asr, processor, dict(inputs)


def text_batch(rows: list[tuple[list[int], list[int]]], pad_id: int, padding_side: str = "right") -> dict:
    """Padded batch from (prompt ids, response ids) pairs; the response is supervised."""
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    am = torch.zeros_like(ids)
    lm = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        seq = torch.tensor(p + r)
        n = len(seq)
        sl = slice(width - n, width) if padding_side == "left" else slice(0, n)
        ids[i, sl] = seq
        am[i, sl] = 1
        m = torch.zeros(n, dtype=torch.bool)
        m[len(p) :] = True
        lm[i, sl] = m
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm}


def random_rows(n: int, vocab: int, prompt_len=(6, 12), resp_len=(10, 24), seed=0, low=3):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        p = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=g))
        r = int(torch.randint(resp_len[0], resp_len[1] + 1, (1,), generator=g))
        rows.append(
            (
                torch.randint(low, vocab, (p,), generator=g).tolist(),
                torch.randint(low, vocab, (r,), generator=g).tolist(),
            )
        )
    return rows


def tiny_draft_config(dflash_config: dict, **fields) -> DFlashConfig:
    """A small standalone `DFlashConfig` (2 layers, 4 heads, 2 KV heads, MLP 64, DFlash architecture);
    `fields` add or override config fields (hidden size, head_dim, vocabulary, block size, ...)."""
    base = dict(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        architectures=["DFlashDraftModel"],
    )
    return DFlashConfig(dflash_config=dflash_config, **(base | fields))


TINY_WHISPER_MASK = 364  # <|0.00|>: a timestamp token, never produced when decoding without timestamps


def tiny_whisper():
    """The sharpened tiny random Whisper of the Whisper tests, and its processor."""
    model, processor = tiny.build_whisper_target(hidden_size=32, num_heads=2, seed=2)
    return tiny.sharpen(model, seed=2), processor


def whisper_features(processor, seed: int, seconds: float = 1.0) -> torch.Tensor:
    """Log-mel features of `seconds` of seeded noise."""
    audio = np.random.default_rng(seed).standard_normal(int(seconds * 16000)).astype(np.float32) * 0.1
    return processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt")["input_features"]


def whisper_draft(target, block: int = 4) -> DFlashDraftModel:
    """A seeded random 1-layer draft for `target` (a model or a `FrozenTarget`) with the tiny Whisper's mask id."""
    ft = target if isinstance(target, FrozenTarget) else FrozenTarget(target)
    cfg = DFlashConfig.from_target_config(
        ft.text_config, mask_token_id=TINY_WHISPER_MASK, num_hidden_layers=1, block_size=block
    )
    cfg.vocab_size = ft.vocab_size
    torch.manual_seed(0)
    return DFlashDraftModel(cfg).eval()


def scripted_draft(draft, reference: torch.Tensor, start: int, right: int | None = None):
    """Make `draft` propose `reference`'s next tokens: all of them (`right` None: every proposal accepted, whole
    blocks), or the next `right` and then wrong ones (cycles of `right + 1` accepted tokens, the target's greedy being
    the reference). `reference[0, start]` is the first anchor."""
    state = {"pos": start}

    def propose_block(hidden, lm_head, anchor_token, temperature, generator):
        pos, n = state["pos"], hidden.shape[0] - 1
        assert anchor_token == int(reference[0, pos])
        tokens = reference[0, pos + 1 : pos + 1 + n].clone()
        tokens = torch.cat([tokens, tokens.new_zeros(n - len(tokens))])
        kept = n if right is None else right
        tokens[kept:] = (tokens[kept:] + 1) % 300
        state["pos"] = pos + kept + 1
        return tokens, None

    draft.propose_block = propose_block
    return draft


def tiny_text_target(num_layers: int = 4, hidden_size: int = 64, seed: int = 0):
    tok = tiny.build_tokenizer()
    model = tiny.build_text_target(tok, num_layers=num_layers, hidden_size=hidden_size, seed=seed)
    return model, tok


def decode_with_proposals(draft, target, max_new_tokens, draft_cuda_graph, **inputs):
    """`speculative_generate` (greedy) recording every cycle's proposal: (output, [proposal per cycle])."""
    from dflash_hf.generation import speculative

    seen = []
    accept = speculative.accept_prefix

    def recording(proposal, *args):
        seen.append(proposal.clone())
        return accept(proposal, *args)

    speculative.accept_prefix = recording
    try:
        out = speculative_generate(draft, target, max_new_tokens, draft_cuda_graph=draft_cuda_graph, **inputs)
    finally:
        speculative.accept_prefix = accept
    return out, seen


class ListDataset(Dataset):
    """Rows (any objects) repeated `repeat` times."""

    def __init__(self, rows, repeat: int = 1):
        self.rows, self.repeat = rows, repeat

    def __len__(self):
        return len(self.rows) * self.repeat

    def __getitem__(self, i):
        return self.rows[i % len(self.rows)]


def make_args(tmp_path, **kw) -> DFlashTrainingArguments:
    base = dict(
        output_dir=str(tmp_path / "out"),
        block_size=4,
        num_draft_layers=2,
        per_device_train_batch_size=4,
        max_steps=1,
        label_source="ground_truth",
        num_anchors=64,
        save_strategy="no",
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        attention_backend="sdpa",
        seed=0,
        eval_real_tau=False,  # decoding in every evaluation: on where a test asks for it (CI time)
    )
    base.update(kw)
    return DFlashTrainingArguments(**base)


def make_trainer(
    tmp_path, model, tok=None, rows=None, *, draft=None, repeat: int = 1, eval_rows=None, **kw
) -> DFlashTrainer:
    """A trainer on hand-built text rows (right padding), or without training data when `rows` is None, with one
    unnamed validation set of `eval_rows` when given; `kw` are `make_args` fields (`mask_token_id` defaults to `tok`'s
    mask token)."""
    if "mask_token_id" not in kw:
        kw["mask_token_id"] = tok.convert_tokens_to_ids(tiny.MASK_TOKEN)
    data = {}
    if rows is not None or eval_rows is not None:
        data["data_collator"] = lambda items: text_batch(items, tok.pad_token_id)
    if rows is not None:
        data["train_dataset"] = ListDataset(rows, repeat)
    if eval_rows is not None:
        data["eval_dataset"] = ListDataset(eval_rows)
    torch.manual_seed(0)
    return DFlashTrainer(model=draft, args=make_args(tmp_path, **kw), target=model, **data)


def assert_lossless_greedy(draft, model, num_prompts: int, max_new_tokens: int) -> None:
    """Speculative greedy decoding of random text prompts equals the target's own greedy decoding."""
    block = draft.config.block_size
    for seed in range(num_prompts):
        prompt = torch.randint(3, 250, (1, 7 + seed), generator=torch.Generator().manual_seed(seed))
        am = torch.ones_like(prompt)
        ref = model.generate(input_ids=prompt, attention_mask=am, max_new_tokens=max_new_tokens, do_sample=False)
        out = speculative_generate(draft, model, max_new_tokens, input_ids=prompt, attention_mask=am)
        assert torch.equal(out.sequences, ref), seed
        assert all(1 <= a <= block for a in out.acceptance_lengths)


def chi_square_p_value(counts: Counter, expected: dict) -> tuple[float, int]:
    """Pearson chi-square p-value (cells with expected count < 5 pooled) and the degrees of freedom."""
    chi2, dof, pool_e, pool_o = 0.0, -1, 0.0, 0
    for cell, e in expected.items():
        o = counts.get(cell, 0)
        if e < 5:
            pool_e, pool_o = pool_e + e, pool_o + o
            continue
        chi2, dof = chi2 + (o - e) ** 2 / e, dof + 1
    if pool_e > 0:
        chi2, dof = chi2 + (pool_o - pool_e) ** 2 / pool_e, dof + 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2))), dof


def mixed_padding_batch(tok, padding_side: str) -> dict:
    """Three random rows plus one with an empty prompt (its first real token supervised), padded on `padding_side`."""
    rows = random_rows(3, 256, prompt_len=(4, 9), resp_len=(8, 20), seed=11)
    rows.append(([], rows[0][1][:12]))  # first real token supervised: its predecessor is padding or nothing
    return text_batch(rows, tok.pad_token_id, padding_side)


def row_inputs(ft: FrozenTarget, batch: dict):
    """Final-normed states and row-coordinate ids / loss mask / doc ids, as `DFlashObjective.loss`
    prepares them (leading padding moved to the end)."""
    feats = ft.capture(batch, [1], keep_final=True)
    packed = "cu_seqlens" in batch
    am = batch["attention_mask"]
    shifts = torch.zeros(am.shape[0], dtype=torch.long) if packed else leading_padding(am)
    am_rows = move_leading_padding(am, shifts)
    final = move_leading_padding(feats.final_hidden, shifts)
    ids = move_leading_padding(batch["input_ids"], shifts)
    loss_mask = move_leading_padding(batch["loss_mask"].bool(), shifts) & am_rows.bool()
    doc_ids = doc_ids_from(am_rows, batch.get("position_ids") if packed else None)
    return final, ids, loss_mask, doc_ids, shifts


class DispatchedOps(TorchDispatchMode):
    """Non-view operators dispatched, by name (`names`)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


class LargestAllocation(TorchDispatchMode):
    """Records the largest freshly allocated tensor (in elements) produced by any op; views of existing
    storage do not count."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


def end_ranks() -> None:
    """The end of a torchrun worker: every rank waits for the others, then the process group is destroyed before the
    interpreter exits (left to exit-time destructors, a rank once aborted with "terminate called without an active
    exception" in CI)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def link_assets(assets: Path, root: Path) -> Path:
    """`root` made, with links to the `target` and `speech` folders of `assets` (a run's inputs, shared by runs)."""
    root.mkdir()
    for name in ("target", "speech"):
        (root / name).symlink_to(assets / name)
    return root


def run_torchrun(cmd: list[str], timeout_s: float) -> None:
    """Run a `torch.distributed.run` command (one thread per rank) to completion. On a timeout, kill torchrun and
    every rank (a rank hung in a collective) and fail; a non-zero exit fails with the end of its stderr."""
    import pytest

    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank
        proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout_s} s (a rank hung in a collective?)")
    assert proc.returncode == 0, stderr[-4000:]


# ------------------------------------------------------------------------------------------ target_cuda_graph
# Batch layouts of the target-graph tests (CPU: tests/targets/test_target_graph.py; GPU: tests/gpu/test_gpu.py):
# case -> whether a batch has padding, as the trainer's CPU plan tells the target (None: packed rows).
GRAPH_CASES = {
    "unpadded": False,
    "padded": True,
    "packed": None,
    "packed_one": None,
    "whisper": True,
    "whisper_unpadded": False,
}


def graph_case(case: str, hidden_size: int = 64) -> tuple[torch.nn.Module, list[dict]]:
    """A tiny target for a `GRAPH_CASES` case and three batches of one signature (shapes equal) whose values and
    layouts (padding, document boundaries) differ from one another."""
    from dflash_hf.data.packing import pack_padded_batch

    if case.startswith("whisper"):
        (model, processor), pad_id = tiny_whisper(), 0
    else:
        (model, tok), processor = tiny_text_target(hidden_size=hidden_size), None
        pad_id = tok.pad_token_id
    batches = []
    for seed, lengths in enumerate(([8, 11, 14], [14, 8, 11], [11, 14, 14])):
        if case in ("unpadded", "whisper_unpadded", "packed_one"):
            lengths = [8, 8, 8]
        elif case == "packed":  # three documents of 45 tokens together, their boundaries moving
            lengths = [lengths[0], lengths[1], 33 - lengths[0] - lengths[1]]
        rows = [(p[:4], r[:n]) for (p, r), n in zip(random_rows(3, 250, seed=seed, resp_len=(17, 20)), lengths)]
        batch = text_batch(rows[:1] if case == "packed_one" else rows, pad_id)
        if case.startswith("packed"):
            batch = pack_padded_batch(batch)
        if case.startswith("whisper"):
            batch["input_ids"] = batch["input_ids"] % 200
            batch["input_features"] = torch.cat([whisper_features(processor, 3 * seed + i) for i in range(3)])
        batches.append(batch)
    return model, batches


def assert_replays_match_eager(
    target: FrozenTarget, batches: list[dict], padded: bool | None, last_call=contextlib.nullcontext
) -> None:
    """Each batch's features through `target.capture` (its `forward_graphs` capture a signature at its second sighting)
    equal the eager forward's bit for bit: taps, final states and an encoder-decoder target's encoder frames. The
    last call (a replay) runs inside `last_call()`."""
    for i, batch in enumerate(batches):
        ref = target.features(batch, [0, 2], keep_final=True, padded=padded)
        with last_call() if i == len(batches) - 1 else contextlib.nullcontext():
            got = target.capture(batch, [0, 2], keep_final=True, padded=padded)
        assert torch.equal(got.taps, ref.taps) and torch.equal(got.final_hidden, ref.final_hidden)
        if ref.encoder_hidden is not None:
            assert torch.equal(got.encoder_hidden, ref.encoder_hidden)


def dflash_train_in_process(argv: list[str]) -> dict:
    """`dflash-train ARGV` in the test process (one process start less than a subprocess), on one thread as the
    subprocesses of the fault tests run; its final metrics."""
    from dflash_hf.cli.train import run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(argv)
    finally:
        torch.set_num_threads(threads)


def assert_bitwise_equal(a: dict, b: dict) -> None:
    """Two name -> tensor dicts (draft weights) with the same names and bit-identical tensors."""
    assert a.keys() == b.keys()
    for name, w in a.items():
        assert torch.equal(w, b[name]), f"{name}: max abs diff {(w - b[name]).abs().max().item():.3g}"


def trainer_weights(trainer) -> dict:
    """A copy of the trained draft's state dict."""
    return {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}


def _dense_column_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) == t.shape[0]


def gpu_scaled_mm_contract(calls: list):
    """A stand-in for `torch._scaled_mm` that asserts what the CUDA operator (row-wise scaling, torch 2.11-2.13)
    accepts and the CPU one does not check: e4m3 operands, the first contiguous and the second dense column-major, the
    shared and the second's output dimension multiples of 16, float32 contiguous scales `[M, 1]` and `[1, N]`, and a
    bfloat16 output. Then runs the real operator and appends the operand shapes to `calls`."""
    real = torch._scaled_mm

    def checked(a, b, *, scale_a, scale_b, out_dtype=None, **kw):
        assert a.dtype == b.dtype == torch.float8_e4m3fn, (a.dtype, b.dtype)
        assert a.is_contiguous(), f"first operand not contiguous row-major: strides {a.stride()}"
        assert _dense_column_major(b), f"second operand not dense column-major: strides {b.stride()}"
        assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0, (a.shape, b.shape)
        assert scale_a.dtype == scale_b.dtype == torch.float32
        assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1]), (scale_a.shape, scale_b.shape)
        assert scale_a.is_contiguous() and scale_b.is_contiguous()
        assert out_dtype == torch.bfloat16, f"row-wise scaling writes bfloat16 only, asked for {out_dtype}"
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, **kw)

    return checked
