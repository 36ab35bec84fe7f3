"""Overlapped steps: the engine schedules step N+1 while step N runs.

A step's host work (scheduling, the sampling rows, turning tokens into outputs) otherwise
sits between two forwards, and the device waits for it. Here one runner thread executes
the steps in the order they were scheduled (``ModelRunner.execute``: swaps, the forward,
sampling), and the engine's own thread meanwhile schedules the next step, with a
PENDING_TOKEN for each token the running step samples (``Scheduler.advance``). Once the
next step is handed over, the engine waits for the running one's tokens and applies them
(``Scheduler.resolve``). The runner thread finishes a step before it starts the next one,
so it puts the real tokens in place of the pending ones itself, and every KV write of a
step happens after the writes of the step before (a block a finished request gave back and
another took is written in step order, on the CPU as on a CUDA stream).

What cannot be done without the running step's tokens makes the engine finish that step
first: preemption (a step scheduled beside a running one never preempts; it reports a
request that did not fit, and the next step is scheduled after the running one ends),
penalties (they read every output token), reading or writing a request's KV from outside
(``Engine.export_kv``, ``add_request(kv=...)``), and ending a request (``Engine.abort``: it
keeps every token computed for it). ``export_prefix_blocks`` need not wait (the running
step never writes full prompt blocks); ``token_ids`` gives what steps returned so far.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from producer.wire.completion import TokenLogprob
from scheduler.output import SchedulerOutput
from worker.engine.model_runner import ModelRunner

StepResult = tuple[dict[str, int], dict[str, TokenLogprob | None]]


class RunnerThread:
    """One thread that runs a ModelRunner's steps, and anything else that touches the
    runner's state, in the order they were submitted."""

    def __init__(self, runner: ModelRunner, device: torch.device) -> None:
        self.runner = runner
        init: Callable[[], None] | None = None
        if device.type == "cuda":  # the thread's current device is the engine's
            # set_device needs an index: "cuda" alone means this thread's current device.
            index = device.index if device.index is not None else torch.cuda.current_device()

            def init() -> None:
                torch.cuda.set_device(index)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine-runner", initializer=init)

    def submit_step(self, out: SchedulerOutput,
                    before: Future[StepResult] | None) -> Future[StepResult]:
        """Run a step once the ones before it ran; ``before``: the step whose sampled
        tokens its PENDING_TOKEN inputs stand for (None: it has none)."""
        return self._pool.submit(self._step, out, before)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on the runner thread, after everything submitted before."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _step(self, out: SchedulerOutput, before: Future[StepResult] | None) -> StepResult:
        # Done already (one thread, in order); its error, if any, is this step's too.
        pending = before.result()[0] if before is not None else None
        return self.runner.execute(out, pending)
