"""The engine: continuous batching of one model on one device, with no I/O but the device.

A request is checked on its way in (``admission``: parameters, prompt, lengths, its token
limit). One step: ``engine`` asks the scheduler for a batch → ``model_runner`` lays it out
(``block_table_rows``; worker.host.step_upload moves it in one host-to-device copy) and runs
the forward → the sampler (worker.sampling) picks tokens → ``output_processor`` turns them
into each request's output. ``step_pipeline`` overlaps a step's scheduling with the forward
before it; ``config`` is every engine setting with its meaning; ``memory`` sets up the
device and lays out the KV memory; ``tokenizer`` encodes prompts and decodes tokens
incrementally. The fleet's KV export and import live with the handoff
(worker/fleet/handoff/engine_kv.py); the models, attention backends and sampler below never
import this package.

``from worker.engine import Engine`` loads torch; ``worker.engine.config`` alone does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.engine.engine import Engine


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from worker.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'worker.engine' has no attribute {name!r}")


__all__ = ["Engine"]
