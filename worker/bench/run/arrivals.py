"""When each request of a workload is submitted: the same plan drives every runner (pure logic)."""

from __future__ import annotations

from worker.bench.run.workloads import WorkItem


class ArrivalPlan:
    """Decides which requests are due, from the clock and the run's progress.

    Without ``concurrency`` a request is due at its ``arrival_s`` (all at t=0, or Poisson
    times) once its ``after_tokens`` condition holds. With ``concurrency`` requests go in
    workload order whenever fewer than that many are in flight (``arrival_s`` is ignored).
    """

    def __init__(self, items: list[WorkItem], concurrency: int | None = None) -> None:
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.items = items
        self.concurrency = concurrency
        self._pending = list(range(len(items)))

    @property
    def done(self) -> bool:
        """True once every request has been handed out."""
        return not self._pending

    def due(self, now_s: float, in_flight: int, max_tokens_seen: int) -> list[int]:
        """Indexes of the requests to submit now; each index is returned once.

        ``max_tokens_seen`` is the most tokens any one request has streamed so far.
        """
        ready = [i for i in self._pending
                 if self.items[i].after_tokens <= max_tokens_seen
                 and (self.concurrency is not None or self.items[i].arrival_s <= now_s)]
        if self.concurrency is not None:
            ready = ready[:max(0, self.concurrency - in_flight)]
        taken = set(ready)
        self._pending = [i for i in self._pending if i not in taken]
        return ready

    def seconds_to_next(self, now_s: float) -> float | None:
        """Time until the next timed arrival; None when the rest wait on progress only."""
        if self.concurrency is not None:
            return None
        times = [self.items[i].arrival_s for i in self._pending
                 if self.items[i].arrival_s > now_s]
        return min(times) - now_s if times else None
