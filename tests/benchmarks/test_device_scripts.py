"""benchmarks/device/session.sh off the device: a trained draft brought home through $OUT in groups, carried back in
and unpacked byte for byte (the multi-session recipe of benchmarks/README.md), and the return limits enforced."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest
from utils import REPO_ROOT

SESSION = REPO_ROOT / "benchmarks" / "device" / "session.sh"


def _session(tmp_path, env_file, *args, out=None, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, DFLASH_DEVICE_ENV=str(env_file), OUT=str(out or tmp_path / "unused"))
    return subprocess.run(
        ["bash", str(SESSION), *args], cwd=cwd or REPO_ROOT, env=env, capture_output=True, text=True, check=False
    )


@pytest.fixture
def device(tmp_path):
    """A fake device: the benchmark cache with one trained run, the env file session.sh sources, and a run name
    of its own (session.sh stages under /tmp, as on the machine)."""
    run = f"test-{uuid.uuid4().hex[:8]}"
    draft = tmp_path / "bench" / "runs" / run / "draft"
    draft.mkdir(parents=True)
    payload = os.urandom(40 * 2**20)  # three pieces of <= 15 MiB
    (draft / "model.safetensors").write_bytes(payload)
    (draft / "config.json").write_text("{}")
    env_file = tmp_path / "env.sh"
    env_file.write_text(
        f"export DFLASH_BENCH_CACHE={tmp_path / 'bench'}\n"
        f'B="{sys.executable} {REPO_ROOT / "benchmarks" / "real_targets.py"}"\nmkdir -p /tmp/logs\n'
    )
    yield run, env_file, payload
    for staged in (f"/tmp/bring/{run}", f"/tmp/stage_{run}"):
        shutil.rmtree(staged, ignore_errors=True)


def test_a_draft_goes_home_in_groups_and_comes_back_byte_for_byte(tmp_path, device):
    run, env_file, payload = device
    first, second = tmp_path / "out1", tmp_path / "out2"
    done = _session(tmp_path, env_file, "bring", run, "group_00", "group_01", out=first)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "groups of" in done.stdout and "group_02" in done.stdout  # says what is left to bring
    assert sorted(p.name for p in (first / run).iterdir()) == ["group_00", "group_01"]
    done = _session(tmp_path, env_file, "bring", run, "group_02", out=second)
    assert done.returncode == 0, done.stdout + done.stderr

    home = tmp_path / "repo"  # what the next session carries: .devcarry/drafts/RUN/group_NN
    for out in (first, second):
        shutil.copytree(out / run, home / ".devcarry" / "drafts" / run, dirs_exist_ok=True)
    for groups in (["group_00", "group_01"], ["group_02"]):  # one call each
        done = _session(tmp_path, env_file, "carry", *(f"drafts/{run}/{g}" for g in groups), cwd=home)
        assert done.returncode == 0, done.stdout + done.stderr
    done = _session(tmp_path, env_file, "unpack", f"drafts/{run}", cwd=home)
    assert done.returncode == 0, done.stdout + done.stderr
    init = tmp_path / "bench" / "init" / run
    assert (init / "model.safetensors").read_bytes() == payload and (init / "config.json").read_text() == "{}"


def test_bring_refuses_more_than_a_call_returns(tmp_path, device):
    run, env_file, _ = device
    out = tmp_path / "out"
    out.mkdir()
    for i in range(7):  # r.tgz and other results already there
        (out / f"result_{i}.json").write_text("{}")
    done = _session(tmp_path, env_file, "bring", run, "group_00", "group_01", out=out)
    assert done.returncode == 1 and "more than the 8 files" in done.stdout
    missing = _session(tmp_path, env_file, "bring", "no-such-run", out=tmp_path / "other")
    assert missing.returncode == 1 and "no draft" in missing.stdout
