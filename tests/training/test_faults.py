"""Fault injection through the real `dflash-train`: SIGKILL it at several points, resume with
`--resume_from_checkpoint true`, and compare the final draft with an uninterrupted run bit for bit.

The runs chain on one output directory (12 utterances = 6 micro-batches per data epoch, gradient
accumulation 2, so 3 optimizer steps per epoch; 8 steps; a checkpoint every 2 steps):

1. killed in the first epoch during gradient accumulation (after micro-batch 1 of step 3);
2. resumed from checkpoint-2, killed during the save of checkpoint-4 (weights written, nothing else);
3. resumed from checkpoint-2 (checkpoint-4 is incomplete and skipped), killed in the second epoch during
   gradient accumulation (after micro-batch 1 of step 6);
4. resumed from checkpoint-4 (second epoch) to the end.

The uninterrupted reference is the same `dflash-train` entry point run in the test process (one thread).

Run as `python tests/training/test_faults.py ARGS` it is `dflash-train ARGS` with the kill point of the environment
variable `DFLASH_TEST_KILL` (`micro:STEP:M`: before micro-batch M after optimizer step STEP; `save:STEP`:
inside the save of checkpoint-STEP, right after its weights are written): the process dies by SIGKILL; or, with
`SIGNAL:STEP:M` (`SIGTERM` or `SIGINT`), the process sends itself that signal before micro-batch M after optimizer
step STEP, as a scheduler does before preemption; or, with `worker:N:MARKER`, a data-loader worker SIGKILLs itself
when it collates its N-th batch, once (it creates the file MARKER first), as the kernel's out-of-memory killer does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (utils) when this file runs as a script
from utils import assert_bitwise_equal, dflash_train_in_process, link_assets  # noqa: E402

HERE = Path(__file__).resolve()
KILL_ENV = "DFLASH_TEST_KILL"
TIMEOUT_S = 300


def cli_args(root: Path) -> list[str]:
    return [
        "--target_name_or_path",
        str(root / "target"),
        "--train_data",
        str(root / "speech" / "manifest.jsonl"),
        "--mask_token_id",
        "262",
        "--output_dir",
        str(root / "out"),
        "--max_steps",
        "8",
        "--gradient_accumulation_steps",
        "2",
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
        "--learning_rate",
        "1e-3",
        "--logging_steps",
        "1",
        "--use_cpu",
        "true",
        "--seed",
        "3",
        "--block_size",
        "4",
        "--num_draft_layers",
        "1",
        "--num_anchors",
        "16",
        "--max_tokens",
        "600",
        "--prompt",
        "Transcribe.",
        "--label_source",
        "ground_truth",
        "--attention_backend",
        "sdpa",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
    ]


def dflash_train(root: Path, *extra: str, kill: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != KILL_ENV}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if kill:
        env[KILL_ENV] = kill
    cmd = [sys.executable, str(HERE), *cli_args(root), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def draft_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from dflash_hf.testing import tiny

    root = tmp_path_factory.mktemp("fault_assets")
    tok = tiny.build_tokenizer()
    tiny.save_tiny_target(root / "target", tokenizer=tok, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)
    tiny.synthesize_speech(root / "speech", 12, seed=0)
    return root


def uninterrupted_dflash_train(root: Path, *extra: str) -> None:
    """The reference run: the same `dflash-train` in this process, one thread as in the subprocesses."""
    dflash_train_in_process(cli_args(root) + list(extra))


@pytest.mark.slow  # five dflash-train runs: 30-60 s on 2 cores
def test_sigkill_at_four_points_then_resume_gives_the_uninterrupted_draft_bit_for_bit(assets, tmp_path):
    ref_root, run_root = link_assets(assets, tmp_path / "ref"), link_assets(assets, tmp_path / "run")
    uninterrupted_dflash_train(ref_root)
    out = run_root / "out"

    first = dflash_train(run_root, kill="micro:2:1")  # first epoch, during gradient accumulation
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]

    saving = dflash_train(run_root, "--resume_from_checkpoint", "true", kill="save:4")  # during a save
    assert saving.returncode == -signal.SIGKILL, saving.stderr[-3000:]
    assert "resuming from" in saving.stderr and "checkpoint-2" in saving.stderr
    assert (out / "checkpoint-4" / "model.safetensors").is_file()
    assert not (out / "checkpoint-4" / "trainer_state.json").exists()  # the interrupted save

    second = dflash_train(run_root, "--resume_from_checkpoint", "true", kill="micro:5:1")  # second epoch, in GA
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    assert "skipped incomplete checkpoints ['checkpoint-4']" in second.stderr, second.stderr[-3000:]
    for step in (2, 4):  # each resumed segment wrote the same checkpoints as the uninterrupted run
        assert_bitwise_equal(
            draft_weights(ref_root / "out" / f"checkpoint-{step}"), draft_weights(out / f"checkpoint-{step}")
        )

    last = dflash_train(run_root, "--resume_from_checkpoint", "true")  # from checkpoint-4: the second epoch
    assert last.returncode == 0, last.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-4'}" in last.stderr
    assert_bitwise_equal(draft_weights(ref_root / "out" / "draft"), draft_weights(out / "draft"))


@pytest.mark.slow  # three dflash-train runs: 15-30 s on 2 cores
@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_saves_a_checkpoint_at_the_step_boundary_and_the_resumed_run_is_bit_identical(
    assets, tmp_path, name
):
    """Before: SIGTERM killed the run with no checkpoint and no message (SIGINT: a KeyboardInterrupt traceback)."""
    ref_root, run_root = link_assets(assets, tmp_path / "ref"), link_assets(assets, tmp_path / "run")
    uninterrupted_dflash_train(ref_root)
    out = run_root / "out"

    stopped = dflash_train(run_root, kill=f"{name}:2:1")  # during gradient accumulation of step 3
    signum = getattr(signal, name)
    assert stopped.returncode == 128 + signum, stopped.stderr[-3000:]
    assert f"received {name}: saving a complete checkpoint at the end of this optimizer step" in stopped.stderr
    assert f"stopped at optimizer step 3, saved {out / 'checkpoint-3'}" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert (out / "checkpoint-3" / "dflash_checkpoint_complete.json").is_file()
    assert not (out / "draft").exists()  # a stopped run exports nothing

    last = dflash_train(run_root, "--resume_from_checkpoint", "true")
    assert last.returncode == 0, last.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-3'}" in last.stderr
    assert_bitwise_equal(draft_weights(ref_root / "out" / "draft"), draft_weights(out / "draft"))


@pytest.mark.slow  # three dflash-train runs with a loader worker: 15-25 s on 2 cores
def test_a_killed_loader_worker_saves_a_checkpoint_at_the_step_boundary_and_the_resume_is_bit_identical(
    assets, tmp_path
):
    """Before: PyTorch's `RuntimeError: DataLoader worker (pid N) is killed by signal: Killed` traceback, exit 1, and
    every step since the last checkpoint lost. Checkpoints only every 100 steps: the one saved is the fault's."""
    ref_root, run_root = link_assets(assets, tmp_path / "ref"), link_assets(assets, tmp_path / "run")
    extra = ("--dataloader_num_workers", "1", "--save_steps", "100")
    uninterrupted_dflash_train(ref_root, *extra)
    out = run_root / "out"

    stopped = dflash_train(run_root, *extra, kill=f"worker:6:{tmp_path / 'killed'}")  # the first epoch's last batch
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert (tmp_path / "killed").is_file()  # the worker did die
    assert "Traceback" not in stopped.stderr
    message = next(line for line in stopped.stderr.splitlines() if line.startswith("dflash-train: stopped: "))
    # PyTorch's words (a worker "killed by signal" or "exited unexpectedly"), or the connection lost to it
    assert "stopped: a data-loader worker died (" in message and "--dataloader_num_workers (now 1)" in message
    saved = sorted(out.glob("checkpoint-*"))
    assert len(saved) == 1 and (saved[0] / "dflash_checkpoint_complete.json").is_file()
    assert f"A complete checkpoint was saved where the run stopped: {saved[0]}; resume from it: `dflash-train " in (
        message
    )
    assert message.endswith("--resume_from_checkpoint true`")
    assert not (out / "draft").exists()

    last = dflash_train(run_root, *extra, "--resume_from_checkpoint", "true")
    assert last.returncode == 0, last.stderr[-3000:]
    assert f"resuming from {saved[0]}" in last.stderr
    assert_bitwise_equal(draft_weights(ref_root / "out" / "draft"), draft_weights(out / "draft"))


def _install_worker_kill(count: int, marker: str) -> None:
    """A loader worker SIGKILLs itself at its `count`-th collation, once (`marker` records that it happened)."""
    from torch.utils.data import get_worker_info

    from dflash_hf.data.collator import PaddedCollator

    collate, seen = PaddedCollator.__call__, [0]

    def killing_collate(self, *args, **kwargs):
        if get_worker_info() is not None:
            seen[0] += 1
            if seen[0] == count and not os.path.exists(marker):
                Path(marker).touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return collate(self, *args, **kwargs)

    PaddedCollator.__call__ = killing_collate


def _install_kill(spec: str) -> None:
    """Patch the trainer so that this process SIGKILLs itself at the kill point `spec`."""
    from dflash_hf.training.trainer import DFlashTrainer

    kind, *numbers = spec.split(":")
    if kind == "worker":
        _install_worker_kill(int(numbers[0]), ":".join(numbers[1:]))
        return
    point = tuple(int(n) for n in numbers)

    def die() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    if kind == "micro" or kind.startswith("SIG"):
        training_step, seen = DFlashTrainer.training_step, {}

        def killing_training_step(self, *args, **kwargs):
            step = self.state.global_step
            if (step, seen.get(step, 0)) == point:
                if kind == "micro":
                    die()
                os.kill(os.getpid(), getattr(signal, kind))
            seen[step] = seen.get(step, 0) + 1
            return training_step(self, *args, **kwargs)

        DFlashTrainer.training_step = killing_training_step
    elif kind == "save":
        save_model = DFlashTrainer.save_model

        def killing_save_model(self, output_dir=None, _internal_call=False):
            save_model(self, output_dir, _internal_call)
            if _internal_call and (self.state.global_step,) == point:
                die()

        DFlashTrainer.save_model = killing_save_model
    else:
        raise ValueError(f"{KILL_ENV}={spec!r}: use micro:STEP:M, save:STEP or SIGTERM:STEP:M")


if __name__ == "__main__":
    if os.environ.get(KILL_ENV):
        _install_kill(os.environ[KILL_ENV])
    from dflash_hf.cli.console import run_command

    sys.exit(run_command("dflash-train", sys.argv[1:]))
