"""Whether a worker is busy: its engine cannot start a request soon (one step has run long,
or the oldest request waiting for room in its batch has waited long).

A request read from its own affinity lane then would queue behind that work while an idle
peer could start it at once: with the fleet KV tier the peer fetches the prefix's KV,
without it computes it again. So a busy worker says it has no room (its heartbeat's
``room`` 0) and takes over nothing from live peers; while a peer has room (or the tier
holds prefixes) it reads only the shared lanes, and its peers take over what waits in its
lanes after the affinity delay (worker/fleet/affinity/takeover.py). Once it is not busy
it reads them again. On a GPU a step lasts milliseconds and a worker is busy only when
requests queue for its batch; on a CPU a long prefill makes it busy too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from producer.clock import SYSTEM_CLOCK, Clock


@dataclass(frozen=True)
class EngineState:
    """Since when (the clock's monotonic seconds) the engine has been in its current step,
    and since when requests have waited for room in its batch; None: not so."""

    step_began: float | None
    waiting_since: float | None


class BusyOwner:
    """Judges, at each read, whether the worker is busy: in one step, or with requests
    waiting, for at least half the affinity delay (so a request that waits the delay in
    its lane finds the worker said so)."""

    def __init__(self, engine_state: Callable[[], EngineState], delay_ms: int,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.engine_state, self.clock = engine_state, clock
        self.after_s = delay_ms / 2000
        self.busy = False  # as of the last check (the heartbeat's ``room`` reads it)
        self.stepping = False  # a step was running at the last check
        self.step_age = 0.0  # ... for this many seconds

    def check(self) -> bool:
        state, now = self.engine_state(), self.clock.monotonic()
        since = [t for t in (state.step_began, state.waiting_since) if t is not None]
        self.stepping = state.step_began is not None
        self.step_age = now - state.step_began if state.step_began is not None else 0.0
        self.busy = bool(since) and now - min(since) >= self.after_s
        return self.busy

    def step_running_long(self) -> bool:
        """Whether the step at the last check had run a fifth of the way to busy (a GPU's
        steps rarely have; a CPU's prefill soon does)."""
        return self.stepping and self.step_age >= self.after_s / 5
