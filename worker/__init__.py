"""The worker side of conveyor: the engine, model runner, fleet process and the CLI.

``from worker import Engine`` loads torch; ``import worker`` alone does not, so the
`conveyor` command (worker.cli.command) starts without torch for verbs that only talk to Redis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from producer.wire import Completion, FinishReason, SamplingParams, Usage

if TYPE_CHECKING:
    from worker.engine.engine import Engine
    from worker.engine.output_processor import StepOutput

# Names served on first use from the torch-backed modules that define them.
_LAZY = {"Engine": "worker.engine.engine", "StepOutput": "worker.engine.output_processor"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'worker' has no attribute {name!r}")


__all__ = ["Completion", "Engine", "FinishReason", "SamplingParams", "StepOutput", "Usage"]
