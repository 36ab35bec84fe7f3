"""Requests' deadlines, soonest first: which live requests have one that has passed.

An entry carries a marker (the engine's output state of the request) that tells a live
entry from one left by a finished request whose id was reused since.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator


class Deadlines:
    """A heap of (deadline, request id) that forgets finished requests, bounded."""

    def __init__(self) -> None:
        # (deadline, tie-break, request id, marker); entries of finished requests linger
        # until popped or compacted.
        self._heap: list[tuple[float, int, str, object]] = []
        # Live requests that have a deadline, and their marker.
        self._live: dict[str, object] = {}
        self._ties = itertools.count()

    def __len__(self) -> int:
        """Entries held, live or not (what a leak check counts)."""
        return len(self._heap) + len(self._live)

    def add(self, request_id: str, deadline: float, marker: object) -> None:
        """Follow a request that must end at ``deadline`` (seconds on the engine's clock)."""
        heapq.heappush(self._heap, (deadline, next(self._ties), request_id, marker))
        self._live[request_id] = marker

    def overdue(self, now: float) -> Iterator[str]:
        """Live requests whose deadline is at or before ``now``, taken out one at a time
        (whether an entry is live is decided as it is reached: ending one request may end
        others)."""
        while self._heap and self._heap[0][0] <= now:
            _, _, request_id, marker = heapq.heappop(self._heap)
            if self._live.get(request_id) is marker:
                yield request_id

    def discard(self, request_id: str) -> None:
        """The request ended: past twice as many heap entries as live ones, the heap drops
        those of finished requests (it must not grow with every request)."""
        self._live.pop(request_id, None)
        if len(self._heap) > 2 * len(self._live):
            self._heap = [e for e in self._heap if self._live.get(e[2]) is e[3]]
            heapq.heapify(self._heap)
