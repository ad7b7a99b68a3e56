"""Suite-wide fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """Console entry points called in-process pick their own CPU thread count (`launch.configure_cpu_threads`);
    restore it so later tests compute with the thread count (and reduction order) they started with."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
