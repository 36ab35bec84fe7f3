"""Following requests' output streams without I/O: what to XREAD next, what a reply means.

:class:`~producer.client.Client` and :class:`~producer.client.AsyncClient` differ
only in how they call XREAD (plainly or awaited). A follower holds everything else: each
stream's last id, the deadline on an injected clock, the BLOCK of the next read, the
events a reply yields (through :class:`~producer.client.stream_events.OutputTracker`), and
whether the streams are done, broken (a gap: :class:`~producer.client.stream_events.StreamGapError`)
or the time is up.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Generic, TypeVar

from producer.client.stream_events import (
    FinalEvent,
    OutputTracker,
    StreamEvent,
    StreamGapError,
    entry_id_key,
    event_from,
    validate_entry_id,
)
from producer.clock import SYSTEM_CLOCK, Clock
from producer.defaults import MAX_BLOCK_MS

T = TypeVar("T")

# An XREAD reply as redis-py returns it: [(stream, [(entry id, fields), ...]), ...], or None.
XReadReply = list[tuple[Any, list[tuple[Any, dict[bytes, bytes]]]]] | None


def deadline_after(timeout: float | None, clock: Clock = SYSTEM_CLOCK) -> float | None:
    """A deadline on ``clock.monotonic()``, ``timeout`` seconds from now; None waits forever."""
    if timeout is None:
        return None
    if (not isinstance(timeout, int | float) or isinstance(timeout, bool) or math.isnan(timeout)
            or timeout < 0):
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
    return clock.monotonic() + timeout


def block_ms(deadline: float | None, clock: Clock = SYSTEM_CLOCK) -> int:
    """BLOCK for the next XREAD: the time left to ``deadline`` on ``clock``, at least 1 ms
    (0 would block forever) and at most MAX_BLOCK_MS (so the socket never times out)."""
    if deadline is None:
        return MAX_BLOCK_MS
    left = math.ceil((deadline - clock.monotonic()) * 1000)
    return max(1, min(MAX_BLOCK_MS, left))


def timed_out(request_id: str, timeout: float | None) -> TimeoutError:
    """The error a reader raises when ``request_id`` had no final entry within ``timeout``."""
    return TimeoutError(f"request {request_id}: no final entry within {timeout} s")


class OutputFollower(ABC, Generic[T]):
    """Follows the output streams of one or more requests, doing no I/O itself.

    A reader loops: XREAD :meth:`streams` with BLOCK :meth:`block_ms`, hand the reply to
    :meth:`feed` and pass on what it returns, then :meth:`check_deadline`; until :attr:`done`.
    A gap met in a reply is raised by the next :meth:`check_deadline`, after the reader has
    passed on the events that came before it.
    """

    def __init__(
        self,
        streams: dict[str, tuple[str, OutputTracker]],
        timeout: float | None,
        clock: Clock,
        max_keys: int,
    ) -> None:
        # Stream key -> (request id, tracker), only for streams still waiting for their final.
        self._open = streams
        self._timeout = timeout
        self._clock = clock
        self._deadline = deadline_after(timeout, clock)
        self._max_keys = max_keys
        # A gap met while feeding: raised once the events before it were handed out.
        self._gap: StreamGapError | None = None

    @property
    def done(self) -> bool:
        """Whether every followed stream has delivered its final entry."""
        return not self._open

    def streams(self) -> dict[str, str]:
        """The next XREAD's streams, each with the id to read after (``max_keys`` at most)."""
        first = list(self._open.items())[: self._max_keys]
        return {key: tracker.last_id for key, (_rid, tracker) in first}

    def block_ms(self) -> int:
        """BLOCK for the next XREAD: the clock's time left, capped by MAX_BLOCK_MS."""
        return block_ms(self._deadline, self._clock)

    def feed(self, reply: XReadReply) -> list[T]:
        """What one XREAD reply yields, each token index once; finished streams close."""
        items: list[T] = []
        for stream, entries in reply or []:
            key = stream.decode() if isinstance(stream, bytes) else stream
            items.extend(self._feed_stream(key, entries))
        return items

    def check_deadline(self) -> None:
        """StreamGapError when the last reply showed lost tokens; else TimeoutError, naming
        the first unfinished request, once the clock passed the deadline."""
        if self._gap is not None:
            raise self._gap
        if self._open and self._deadline is not None and self._clock.monotonic() >= self._deadline:
            request_id, _tracker = next(iter(self._open.values()))
            raise timed_out(request_id, self._timeout)

    def _feed_stream(self, key: str, entries: list[tuple[Any, dict[bytes, bytes]]]) -> list[T]:
        if key not in self._open:
            return []
        request_id, tracker = self._open[key]
        items: list[T] = []
        for entry_id, fields in entries:
            try:
                event = tracker.feed(entry_id, fields)
            except StreamGapError as gap:
                # Nothing more is read: the events before the gap are still handed out.
                self._gap = gap
                self._open.clear()
                break
            if event is not None:
                items.append(self._item(request_id, event))
            if tracker.done:
                # Nothing follows a final entry: stop reading this stream.
                del self._open[key]
                break
        return items

    @abstractmethod
    def _item(self, request_id: str, event: StreamEvent) -> T:
        """What the reader yields for ``event`` of ``request_id``."""


class StreamFollower(OutputFollower[StreamEvent]):
    """One request's output stream, read after entry ``from_id``: yields its events."""

    def __init__(
        self, request_id: str, key: str, from_id: str, timeout: float | None, clock: Clock
    ) -> None:
        self.key = key
        self.from_id = validate_entry_id(from_id)
        # The final entry the reader had already passed when it resumed (see probe).
        self.finished_before: FinalEvent | None = None
        tracker = OutputTracker(self.from_id, request_id)
        super().__init__({key: (request_id, tracker)}, timeout, clock, max_keys=1)

    @property
    def needs_probe(self) -> bool:
        """Whether the reader resumes after some entry: it must first look at the stream's
        last entry (XREVRANGE key + - COUNT 1) and hand it to :meth:`probe`."""
        return entry_id_key(self.from_id) > (0, 0)

    def probe(self, last: list[tuple[Any, dict[bytes, bytes]]]) -> None:
        """Take the stream's last entry (as XREVRANGE returns it). When it is a final entry
        at or before ``from_id`` the reader has seen the end already: the follower is done
        at once (nothing is yielded; the final is kept in :attr:`finished_before`), instead
        of waiting for entries that will never come."""
        if not last:
            return
        entry_id, fields = last[0]
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        if entry_id_key(eid) > entry_id_key(self.from_id):
            return
        event = event_from(eid, fields)
        if isinstance(event, FinalEvent):
            self.finished_before = event
            self._open.clear()

    def _item(self, request_id: str, event: StreamEvent) -> StreamEvent:
        return event


class ManyFollower(OutputFollower[tuple[str, StreamEvent]]):
    """Many requests' output streams from their start: yields (request id, event) pairs.

    ``keys`` maps each stream key to its request id; one XREAD covers ``max_keys`` streams.
    """

    def __init__(
        self, keys: dict[str, str], timeout: float | None, clock: Clock, max_keys: int
    ) -> None:
        streams = {key: (rid, OutputTracker(request_id=rid)) for key, rid in keys.items()}
        super().__init__(streams, timeout, clock, max_keys)

    def _item(self, request_id: str, event: StreamEvent) -> tuple[str, StreamEvent]:
        return request_id, event
