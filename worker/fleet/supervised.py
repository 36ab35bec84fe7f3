"""The one shape of every worker thread: a loop of ticks, watched.

A tick that meets a Redis error that may pass (connection lost, timeout, server loading,
or a refusal: out of memory, read-only replica, a missing group, a changed ACL) is retried
after a backoff on the worker's clock, and the thread reports itself unhealthy until a
tick succeeds again: the heartbeat shows it. Any other error is a bug or a
state the thread cannot mend: it is logged with its traceback and the worker is told
(``on_fatal``), which brings the whole worker down after handing its entries back.
A thread never dies silently while the others go on renewing leases for work it dropped.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import redis
import structlog

from producer.clock import Clock
from producer.logging import bind_thread_context
from worker.fleet.thread_names import name_this_thread
from worker.host.thread_policy import yield_to_computing_threads

log = structlog.get_logger(__name__)

# Errors after which the same tick may succeed later: the connection (BusyLoadingError is a
# ConnectionError) or a refusal by the server (ResponseError: OOM, READONLY, NOGROUP, NOPERM).
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError, redis.TimeoutError, redis.ResponseError)

# Backoff before retry n after a transient error: a random 50-100% of FIRST * 2**n, at most CAP
# (jitter spreads a fleet's reconnects after a Redis restart).
BACKOFF_FIRST_S = 0.1
BACKOFF_CAP_S = 2.0


def backoff_s(attempt: int, rng: random.Random) -> float:
    """Seconds to wait before retry ``attempt`` (0-based)."""
    return min(BACKOFF_CAP_S, BACKOFF_FIRST_S * 2**min(attempt, 16)) * rng.uniform(0.5, 1.0)


class SupervisedThread(threading.Thread):
    """Calls ``tick()`` until stopped, ``interval_s`` of the clock apart (0: back to back).

    Subclasses implement ``tick``; a tick that blocks (a read, a queue) should return within
    about a second so ``stop`` is noticed.
    """

    def __init__(self, name: str, *, worker_id: str, clock: Clock, interval_s: float = 0.0,
                 on_fatal: Callable[[SupervisedThread], None] | None = None) -> None:
        super().__init__(name=name, daemon=True)
        self.worker_id = worker_id
        self.clock = clock
        self.interval_s = interval_s
        self.on_fatal = on_fatal
        self.stopping = threading.Event()
        # The error that ended this thread, if one did.
        self.failure: BaseException | None = None
        # Transient errors met so far, and the last one while the thread is still retrying.
        self.transient_errors = 0
        self.retrying: BaseException | None = None
        self._attempt = 0  # transient failures in a row, for the backoff
        self.ticks = 0  # ticks that returned normally
        self._rng = random.Random()
        # Run under SCHED_BATCH (worker.host.thread_policy): set for the I/O threads, so
        # that they never preempt the engine's computing threads when they wake up.
        self.yields_to_compute = False
        # Called first thing on the thread (worker.host.cpu_placement pins it there).
        self.on_start: Callable[[], object] | None = None

    def tick(self) -> None:
        raise NotImplementedError

    @property
    def healthy(self) -> bool:
        """Neither failed nor retrying (the loop only ends on stop() or a failure)."""
        return self.failure is None and self.retrying is None

    def stop(self, timeout: float | None = None) -> None:
        """Ask the loop to end and wait for it (a thread never started returns at once)."""
        self.stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def working(self) -> None:
        """Say the thread reaches Redis again. The loop says it after every tick that
        returns; a tick that runs long (a subscription) says it once it is connected."""
        if self.retrying is not None:
            log.info("worker thread recovered", thread=self.name, attempts=self._attempt)
            self.retrying = None
        self._attempt = 0

    def run(self) -> None:
        name_this_thread(self.name)
        bind_thread_context(worker_id=self.worker_id)
        if self.yields_to_compute:
            yield_to_computing_threads()
        if self.on_start is not None:
            try:
                self.on_start()
            except Exception as exc:  # the thread serves where it is, as unplaced
                log.warning("thread start hook failed", thread=self.name, error=repr(exc))
        while not self.stopping.is_set():
            try:
                self.tick()
            except TRANSIENT_ERRORS as exc:
                self._retrying(exc)
                self.clock.wait(self.stopping, backoff_s(self._attempt, self._rng))
                self._attempt += 1
                continue
            except BaseException as exc:  # reported, then the worker goes down
                self.failure = exc
                log.error("worker thread failed", thread=self.name, error=repr(exc),
                          exc_info=exc)
                if self.on_fatal is not None:
                    self.on_fatal(self)
                return
            self.ticks += 1
            self.working()
            if self.interval_s > 0:
                self.clock.wait(self.stopping, self.interval_s)

    def _retrying(self, exc: BaseException) -> None:
        self.transient_errors += 1
        if self.retrying is None:
            # The first failure of a run carries the traceback; retries only say they go on.
            log.warning("worker thread cannot use redis, retrying", thread=self.name,
                        error=str(exc), exc_info=exc)
        else:
            log.debug("worker thread still retrying", thread=self.name, attempt=self._attempt,
                      error=str(exc))
        self.retrying = exc
