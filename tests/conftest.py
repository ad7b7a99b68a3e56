"""Suite-wide fixtures and set-up for the three tiers (`unit/`, `integration/`, `gpu/`).

`tests/` is put on `sys.path` so every tier imports the shared helpers as `from utils import ...` (and
`dist_train`); scripts that a test starts as a separate process (torchrun workers, `python FILE`) insert it
themselves.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """Console entry points called in-process pick their own CPU thread count (`launch.configure_cpu_threads`);
    restore it so later tests compute with the thread count (and reduction order) they started with."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
