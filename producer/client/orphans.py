"""A reader's wait that does not go on for nothing, without I/O of its own.

A client that waits for a request it submitted looks, every LOOK_S seconds without news,
at two things: whether the request's model has a live worker (past ``orphan_timeout``
seconds without one: NoLiveWorker), and whether anything still holds the request: its
lane entry (found by the entry id the client kept at submit, never by scanning), a
worker's pending list, or its output stream (a handed-on request has its first tokens
there). Held by nothing: RequestLost, at once. Client and AsyncClient do the reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from producer.clock import Clock
from producer.wire.errors import NoLiveWorker, RequestLost
from producer.wire.keys import GROUP

# A waiting reader looks this often (seconds of its clock) when no entry came ...
LOOK_S = 2.0
# ... and first this soon after it starts waiting, so that a lost request is found at once.
FIRST_LOOK_S = 0.1
# How long a reader waits while its request's model has no live worker (None: forever).
ORPHAN_TIMEOUT_S = 60.0
# Requests a client remembers where it put them, for the look (the oldest are forgotten).
MAX_REMEMBERED = 20_000


@dataclass(frozen=True)
class Submitted:
    """Where a client put a request: its model, lane stream, and entry id (None where the
    XADD was pipelined and its id never came back)."""

    model: str
    key: str
    entry_id: str | None


def queue_look(pipe: Any, lane: str, entry_id: str | None, output: str) -> int:
    """Queue the reads of a look at one request on ``pipe`` (sync or asyncio): XINFO GROUPS
    of its ``lane`` and XPENDING of its entry (when its ``entry_id`` is known), then EXISTS
    of its ``output`` stream; :func:`held_from` reads their replies. Returns how many."""
    if entry_id is None:
        pipe.exists(output)
        return 1
    pipe.xinfo_groups(lane)
    pipe.xpending_range(lane, GROUP, entry_id, entry_id, 1)
    pipe.exists(output)
    return 3


def held_from(replies: list[object], entry_id: str | None, group: str) -> bool | None:
    """Whether anything holds the request, from a look's replies (None where a reply was an
    error or the entry id is unknown): with its lane ``entry_id``, XINFO GROUPS of the lane
    and XPENDING of the entry, then EXISTS of its output stream.

    A request only moves forward through those (waiting, delivered and pending, output
    written): read in that order, a look never misses it between two of them. No reply
    reads an entry's content (a producer may not read others' prompts): an entry past
    ``group``'s last delivered id still waits in the lane; one at or before it, pending
    nowhere, with no output stream, was lost (or its output expired)."""
    out = replies[-1]
    if isinstance(out, Exception):
        return None
    if out:
        return True
    if entry_id is None:
        return None
    groups, pending = replies[0], replies[1]
    if isinstance(pending, Exception) and "nogroup" not in str(pending).lower():
        return None  # refused (an ACL from before XPENDING was granted): cannot tell
    if isinstance(pending, list) and pending:
        return True
    if isinstance(groups, Exception):
        # The lane itself is gone (a failover, a flush): so is the entry.
        return False if "no such key" in str(groups).lower() else None
    delivered = next((g.get("last-delivered-id") for g in groups or []
                      if _text(g.get("name")) == group), None)
    return delivered is None or _id_key(entry_id) > _id_key(_text(delivered))


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class OrphanWatch:
    """One wait's looks: when the next is due, and what its findings mean."""

    def __init__(self, request_id: str, submitted: Submitted, timeout: float | None,
                 clock: Clock) -> None:
        self.request_id = request_id
        self.submitted = submitted
        self.timeout = timeout
        self.clock = clock
        self._next_look = clock.monotonic() + FIRST_LOOK_S
        self._alone_since: float | None = None

    def due(self) -> bool:
        return self.clock.monotonic() >= self._next_look

    def block_ms(self) -> int:
        """How long the next read may block before a look is due (at least 1 ms)."""
        return max(1, math.ceil((self._next_look - self.clock.monotonic()) * 1000))

    def heard(self) -> None:
        """An entry came: a worker serves the request; look again only after LOOK_S."""
        self._alone_since = None
        self._next_look = self.clock.monotonic() + LOOK_S

    def judge(self, live: bool, held: bool | None) -> None:
        """Take a look's findings: ``live`` (the model has a live worker) and ``held``
        (anything holds the request; None: unknown). Raises RequestLost or NoLiveWorker."""
        now = self.clock.monotonic()
        self._next_look = now + LOOK_S
        if held is False:
            raise RequestLost(self.request_id, self.submitted.key)
        if live:
            self._alone_since = None
            return
        if self._alone_since is None:
            self._alone_since = now
        if self.timeout is not None and now - self._alone_since >= self.timeout:
            raise NoLiveWorker(self.request_id, self.submitted.model, self.timeout)
