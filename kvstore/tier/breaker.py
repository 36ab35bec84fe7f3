"""A circuit breaker for the KV tier: after a round trip fails, stop using the tier for a while.

The tier is an optimisation: a transfer that cannot happen is a recompute, never an error.
So a tier that stops answering must not cost every request its timeout; after a failure the
breaker opens and the tier is skipped (hand on without KV, recompute, fetch nothing) for
``open_s`` seconds; then one call probes it (half-open) while the others still skip it, and
its success closes the breaker again, its failure opens it for another ``open_s``.

A refusal (the tier is full, Redis answers OOM) is an answer: it proves the tier reachable.
Only a round trip without a usable answer counts as a failure: a timeout, a connection
lost or refused (redis-py counts a server still loading its data, or a failed AUTH, as
connection errors too). An answer closes the breaker only for a call let through since
it last opened (the probe): a quick answer to a call made before a timeout proves nothing.
One breaker serves every tier client of a worker: they share one Redis.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half-open"

DEFAULT_OPEN_S = 30.0


class Breaker:
    """Whether the tier may be used now; thread-safe (intake, publisher and tier threads)."""

    def __init__(self, open_s: float = DEFAULT_OPEN_S,
                 now: Callable[[], float] = time.monotonic) -> None:
        if not open_s > 0:
            raise ValueError(f"open_s must be > 0, got {open_s!r}")
        self.open_s = open_s
        self.now = now  # monotonic seconds; tests move it
        self._lock = threading.Lock()
        self._state = CLOSED
        self._until = 0.0
        # Bumped each time it opens: a call's answer counts only for its own generation.
        self._generation = 0
        # Times it opened, and calls it turned away, for the heartbeat and metrics.
        self.opened = 0
        self.skipped = 0

    @property
    def state(self) -> str:
        with self._lock:
            if self._state == OPEN and self.now() >= self._until:
                return HALF_OPEN  # the next call probes
            return self._state

    def allow(self) -> int | None:
        """The call's generation where the caller may use the tier now (as the probe, once
        it has been open for ``open_s``), to hand back to :meth:`succeeded`; None: skip it,
        as if it had refused."""
        with self._lock:
            if self._state == CLOSED:
                return self._generation
            if self._state == OPEN and self.now() >= self._until:
                self._state = HALF_OPEN  # this caller probes; the others keep skipping
                return self._generation
            self.skipped += 1
            return None

    def succeeded(self, generation: int) -> None:
        """A round trip of a call let through in ``generation`` got its answer."""
        with self._lock:
            if generation == self._generation:
                self._state = CLOSED

    def failed(self) -> None:
        """A round trip got no answer: skip the tier for ``open_s``."""
        with self._lock:
            if self._state != OPEN:
                self.opened += 1
            self._state = OPEN
            self._until = self.now() + self.open_s
            self._generation += 1
