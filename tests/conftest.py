"""Suite-wide fixtures and set-up.

The test tree mirrors the package's folders (`tests/<folder>/` tests `dflash_hf/<folder>/`; `tests/benchmarks/` the
scripts; `tests/gpu/` needs CUDA and is marked `gpu`); `test_layout.py` keeps both layouts. Tests over 5 s on two
CPU cores are marked `slow`: `-m "not slow"` is the quick loop. Shared helpers (batches, argument and trainer
factories) live in `utils.py`, shared fixtures here.

`tests/` is put on `sys.path` so every folder imports the helpers as `from utils import ...` (and `dist_train`);
scripts that a test starts as a separate process (torchrun workers, `python FILE`) insert it themselves.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dflash_hf.testing import tiny

TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """Console entry points called in-process pick their own CPU thread count (`ops.cpu_threads.configure_cpu_threads`);
    restore it so later tests compute with the thread count (and reduction order) they started with."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def asr_target():
    """(model, processor): a tiny random Qwen3-ASR target (2 layers, hidden 32), one per test module."""
    return tiny.build_qwen3_asr_target(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def text_target_4x64():
    """(model, tokenizer): a tiny random text target (4 layers, hidden 64, seed 3), one per test module."""
    from utils import tiny_text_target

    return tiny_text_target(num_layers=4, hidden_size=64, seed=3)
