"""The GPU suite: every test here needs CUDA and is skipped, with the reason, without it.

Run it with `bash scripts/gpu-check.sh` on a machine with a GPU (it also runs the decode
benchmark on the device).
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = str(config.rootpath / "tests" / "gpu")
    no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.cuda)
            item.add_marker(no_cuda)
