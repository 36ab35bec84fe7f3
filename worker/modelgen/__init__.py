"""Small deterministic Hugging Face-format checkpoints, written locally for tests and benchmarks.

``make_model`` (torch) is served on first use, so ``worker.modelgen.ensure`` and the presets
load without torch.
"""

from __future__ import annotations

from typing import Any

from worker.modelgen.presets import ARCHS, LLAMA3_ROPE_SCALING, PRESETS


def __getattr__(name: str) -> Any:
    if name == "make_model":
        from worker.modelgen.make_model import make_model

        # Importing the submodule bound its name here to the module: bind the function.
        globals()["make_model"] = make_model
        return make_model
    raise AttributeError(f"module 'worker.modelgen' has no attribute {name!r}")


__all__ = ["ARCHS", "LLAMA3_ROPE_SCALING", "PRESETS", "make_model"]
