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
(``Engine.settle``, which worker/fleet/handoff/engine_kv.py calls before it exports or
imports KV), and ending a request (``Engine.abort``: it keeps every token computed for it).
Exporting full prompt blocks need not wait (the running step never writes them);
``Engine.token_ids`` gives what steps returned so far.

``RunnerThread`` is the runner's side; ``OverlappedSteps`` the engine's: the step in flight,
and the outputs of steps finished outside ``Engine.step``. The runner thread times each
step it runs (swaps, forward, sampling: on CUDA it waits for the device before sampling),
and the engine tells the scheduler when it applies the step's tokens: with an inter-token
target, that is what the cost model learns (scheduler/step_cost.py).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from producer.clock import SYSTEM_CLOCK, Clock
from producer.wire.completion import TokenLogprob
from scheduler import RequestUpdate, Scheduler
from scheduler.output import SchedulerOutput
from worker.engine.model_runner import ModelRunner
from worker.engine.output_processor import StepOutput
from worker.sampling.prompt_logprobs import PromptSpan

# A step's sampled tokens, their logprobs, its prompt spans, and the seconds the runner
# thread took for it.
TimedStep = tuple[dict[str, int], dict[str, TokenLogprob | None], dict[str, PromptSpan], float]
# Turns a step's scheduler updates and logprobs into each request's output (the engine's).
OutputsOf = Callable[[list[RequestUpdate], dict[str, Any], dict[str, PromptSpan]],
                     list[StepOutput]]


class RunnerThread:
    """One thread that runs a ModelRunner's steps, and anything else that touches the
    runner's state, in the order they were submitted."""

    def __init__(self, runner: ModelRunner, device: torch.device,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.runner = runner
        self.clock = clock
        init: Callable[[], None] | None = None
        if device.type == "cuda":  # the thread's current device is the engine's
            # set_device needs an index: "cuda" alone means this thread's current device.
            index = device.index if device.index is not None else torch.cuda.current_device()

            def init() -> None:
                torch.cuda.set_device(index)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine-runner", initializer=init)

    def submit_step(self, out: SchedulerOutput,
                    before: Future[TimedStep] | None) -> Future[TimedStep]:
        """Run a step once the ones before it ran; ``before``: the step whose sampled
        tokens its PENDING_TOKEN inputs stand for (None: it has none)."""
        self.runner.queued(out)
        return self._pool.submit(self._step, out, before)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on the runner thread, after everything submitted before."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _step(self, out: SchedulerOutput, before: Future[TimedStep] | None) -> TimedStep:
        # Done already (one thread, in order); its error, if any, is this step's too.
        pending = before.result()[0] if before is not None else None
        began = self.clock.monotonic()
        tokens, logprobs, prompt = self.runner.execute(out, pending)
        return tokens, logprobs, prompt, self.clock.monotonic() - began


class OverlappedSteps:
    """The engine's side of overlapped steps: schedules a step while the one before it runs
    on the runner thread, and keeps what finished outside ``Engine.step``."""

    def __init__(self, runner: ModelRunner, device: torch.device, scheduler: Scheduler,
                 outputs_of: OutputsOf, clock: Clock = SYSTEM_CLOCK) -> None:
        self.runner = runner
        self.thread = RunnerThread(runner, device, clock)
        self.scheduler = scheduler
        self.outputs_of = outputs_of
        # The step running on the runner thread (scheduled, advanced, tokens not applied).
        self.inflight: tuple[SchedulerOutput, Future[TimedStep]] | None = None
        # Outputs of a step finished outside step() (to read KV or tokens): the next step's.
        self.ready: list[StepOutput] = []
        # The last step scheduled beside a running one left a request out for lack of
        # blocks: schedule the next with nothing running, so that it may preempt.
        self.sync_next = False
        # Steps scheduled while the step before them ran.
        self.num_overlapped_steps = 0

    @property
    def busy(self) -> bool:
        """A step runs, or outputs wait for the next ``step``."""
        return self.inflight is not None or bool(self.ready)

    def step(self, outputs: list[StepOutput], must_sync: bool) -> tuple[list[StepOutput], bool]:
        """Hand the next step to the runner thread and apply the running one's tokens;
        (``outputs`` and the outputs ready now, whether a step was scheduled).
        ``must_sync``: finish the running step before scheduling (penalties read every token)."""
        outputs, self.ready = self.ready + outputs, []
        if self.inflight is not None and (self.sync_next or must_sync):
            outputs += self.finish_inflight()
        before = self.inflight
        sched = self.scheduler.schedule(may_preempt=before is None)
        self.sync_next = sched.starved
        if sched.is_empty:
            self.thread.submit(self.runner.release, sched)  # after the running step, in order
            return outputs + (self.finish_inflight() if before is not None else []), False
        future = self.thread.submit_step(sched, before[1] if before is not None else None)
        if before is not None:
            self.num_overlapped_steps += 1
            outputs += self.finish_inflight()
        # After the running step's tokens: a request they finished gets no pending token.
        self.scheduler.advance(sched)
        self.inflight = (sched, future)
        return outputs, True

    def finish_inflight(self) -> list[StepOutput]:
        """Wait for the running step's tokens and apply them."""
        assert self.inflight is not None
        sched, future = self.inflight
        self.inflight = None
        tokens, logprobs, prompt, seconds = future.result()
        outputs = self.outputs_of(self.scheduler.resolve(sched, tokens), logprobs, prompt)
        self.scheduler.observe_step(sched, seconds)
        return outputs

    def settle(self) -> None:
        """Finish the running step, if any (its outputs come with the next step())."""
        if self.inflight is not None:
            self.ready += self.finish_inflight()

    def take_ready(self, request_id: str) -> list[StepOutput]:
        """The outputs of ``request_id`` waiting for the next step(), taken out."""
        mine = [o for o in self.ready if o.request_id == request_id]
        if mine:
            self.ready = [o for o in self.ready if o.request_id != request_id]
        return mine

    def close(self) -> None:
        self.thread.close()
