"""Benchmarks ask for their own torch thread count; give the rest of the suite its one back."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
