"""Time as an input: code that decides by the clock takes a Clock, and tests move it.

``SystemClock`` is the real one. ``ManualClock`` stands still until ``advance`` moves it,
so a test decides exactly when a deadline passes, a lease is due or a backoff ends,
whatever the machine's speed.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

# How often (real seconds) a ManualClock waiter re-checks the event it also waits for.
_MANUAL_POLL_S = 0.01


class Clock(Protocol):
    """What time-deciding code may ask of time."""

    def time(self) -> float:
        """Unix seconds: for deadlines, which producers set on their own clocks."""
        ...

    def monotonic(self) -> float:
        """Seconds from an arbitrary start that never go back: for intervals and timeouts."""
        ...

    def wait(self, event: threading.Event, timeout: float) -> bool:
        """Wait until ``event`` is set or ``timeout`` seconds of this clock have passed;
        returns whether the event is set."""
        ...


class SystemClock:
    """The real clock."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def wait(self, event: threading.Event, timeout: float) -> bool:
        return event.wait(max(0.0, timeout))


SYSTEM_CLOCK = SystemClock()


class ManualClock:
    """A clock that moves only when told to; thread-safe. Waits end when it passes them."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        # Unix time at monotonic() == 0; both move together.
        self._unix_at_zero = start
        self._now = 0.0
        self._cond = threading.Condition()

    def time(self) -> float:
        with self._cond:
            return self._unix_at_zero + self._now

    def monotonic(self) -> float:
        with self._cond:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward, waking every wait that is now over."""
        if seconds < 0:
            raise ValueError("a clock does not go back")
        with self._cond:
            self._now += seconds
            self._cond.notify_all()

    def wait(self, event: threading.Event, timeout: float) -> bool:
        with self._cond:
            end = self._now + max(0.0, timeout)
            while not event.is_set() and self._now < end:
                # The event is set by other code that does not know this condition: poll it.
                self._cond.wait(_MANUAL_POLL_S)
        return event.is_set()
