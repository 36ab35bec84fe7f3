"""The KV tier's I/O on threads of its own, so that a slow or frozen tier never holds the
threads that publish tokens and read requests.

- ``TierWriter`` takes the publisher's hand-ons (the KV put, then the atomic hand-on) and
  shared prefix blocks from a bounded queue.
- ``TierReader`` takes the intake's admissions that may start from KV in the tier (a
  handed-on request, a shared prefix), fetches it, and passes them to the engine loop.

Where a queue is full, the work goes on without the tier: a hand-on without its KV (the
decode worker recomputes), a prefix left unshared, an admission without its KV. A frozen
tier costs each round trip at most the tier's timeout, and the breaker
(kvstore/tier/breaker.py) then skips the tier altogether for a while.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any

import structlog

from worker.fleet.handoff.handoff import HandoffReader, HandOnWriter
from worker.fleet.handoff.prefix_share import PrefixSharer
from worker.fleet.messages import Admission, HandOn, SharePrefix
from worker.fleet.supervised import SupervisedThread

log = structlog.get_logger(__name__)

# Tier transfers waiting on a tier thread before new work goes on without the tier.
DEFAULT_QUEUE = 64
# How long an idle tier thread waits for work before it looks at its stop flag again.
IDLE_WAIT_S = 0.2


class _Bounded:
    """A bounded FIFO whose head stays put until its work is done (a retried tick redoes it)."""

    def __init__(self, max_waiting: int) -> None:
        if max_waiting < 1:
            raise ValueError(f"a tier queue holds at least 1 item, got {max_waiting!r}")
        self.max_waiting = max_waiting
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()

    def offer(self, item: Any) -> bool:
        with self._cond:
            if len(self._items) >= self.max_waiting:
                return False
            self._items.append(item)
            self._cond.notify()
            return True

    def head(self, timeout: float) -> Any | None:
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)
            return self._items[0] if self._items else None

    def done(self) -> None:
        with self._cond:
            self._items.popleft()
            self._cond.notify_all()

    def wait_empty(self, timeout: float) -> bool:
        """Whether the queue emptied within ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items, timeout)

    def take_all(self, keep_head: bool = False) -> list[Any]:
        """Everything queued, taken out; ``keep_head``: but the head, which a thread that
        did not stop may still be working on."""
        with self._cond:
            kept = [self._items[0]] if keep_head and self._items else []
            items = list(self._items)[len(kept):]
            self._items = deque(kept)
            return items

    def __len__(self) -> int:
        return len(self._items)


class _TierThread(SupervisedThread):
    """A thread that works through a bounded queue, one item a tick, in order."""

    def __init__(self, name: str, worker_id: str, max_waiting: int,
                 **supervision: Any) -> None:
        super().__init__(name, worker_id=worker_id, **supervision)
        self._queue = _Bounded(max_waiting)
        # Items the caller sent on without this thread: the queue was full.
        self.overflowed = 0

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def offer(self, item: Any) -> bool:
        """Queue ``item``; False (counted) where the queue is full."""
        if self._queue.offer(item):
            return True
        self.overflowed += 1
        return False

    def tick(self) -> None:
        item = self._queue.head(IDLE_WAIT_S)
        if item is None:
            return
        self._work(item)  # raising, it stays at the head: the retried tick redoes it
        self._queue.done()

    def _work(self, item: Any) -> None:
        raise NotImplementedError

    def _drain(self, drain_s: float) -> list[Any]:
        """Let what is queued be worked through as usual for up to ``drain_s`` seconds, stop,
        and take out what is left (but an item the thread, if still running, works on)."""
        self._queue.wait_empty(drain_s)
        self.stop(timeout=drain_s)
        return self._queue.take_all(keep_head=self.is_alive())


class TierWriter(_TierThread):
    """Hand-ons and shared prefixes, written off the publisher's thread, in order.

    A hand-on's tier errors are its own (it goes on without KV); a lost connection to the
    queues' Redis during its hand-on script fails the tick, and the supervisor retries it
    (the put is an overwrite, the script checks the entry is still this worker's). Where
    ``offer`` refuses, a hand-on goes on without KV and prefix blocks are not shared."""

    def __init__(self, hand_on: HandOnWriter | None, prefixes: PrefixSharer | None,
                 worker_id: str, max_waiting: int = DEFAULT_QUEUE,
                 **supervision: Any) -> None:
        super().__init__("kv-tier-writer", worker_id, max_waiting, **supervision)
        self.hand_on = hand_on
        self.prefixes = prefixes

    def _work(self, item: HandOn | SharePrefix) -> None:
        self._write(item, with_kv=True)

    def close(self, drain_s: float, reachable: bool) -> None:
        """Let what is queued go out as usual for up to ``drain_s`` seconds (a drain loses
        no KV), then stop. What is left is handed on without KV where the queues' Redis is
        ``reachable`` (it took the publisher's last writes); else it is left as it is: its
        lane entries lapse and another worker claims them, rather than this one waiting a
        timeout per hand-on on a Redis that does not answer. Prefix blocks left are not
        shared."""
        left = self._drain(drain_s)  # none of them handed on
        if not reachable:
            return
        for item in left:
            if isinstance(item, HandOn):
                try:
                    self._write(item, with_kv=False)
                except Exception as exc:  # its lane entry lapses and is claimed elsewhere
                    log.warning("hand-on not written at stop", request_id=item.request_id,
                                error=str(exc))
                    return

    def _write(self, item: HandOn | SharePrefix, with_kv: bool) -> None:
        if isinstance(item, HandOn):
            assert self.hand_on is not None, "a hand-on without a HandOnWriter"
            self.hand_on.write(item, with_kv=with_kv)
        elif self.prefixes is not None:
            self.prefixes.write(item)


class TierReader(_TierThread):
    """Admissions whose KV may be in the tier (``adm.kv_fetch``): fetched here, then passed
    to the engine loop's inbox, with their KV or without it. Where ``offer`` refuses, the
    caller passes the admission on without KV."""

    def __init__(self, inbox: queue.Queue[list[Admission]], worker_id: str,
                 max_waiting: int = DEFAULT_QUEUE, handoffs: HandoffReader | None = None,
                 **supervision: Any) -> None:
        super().__init__("kv-tier-reader", worker_id, max_waiting, **supervision)
        self.inbox = inbox
        # Counts the handed-on requests sent on without their KV at a stop.
        self.handoffs = handoffs

    def _work(self, adm: Admission) -> None:
        resolve(adm)
        self.inbox.put([adm])

    def close(self, drain_s: float) -> None:
        """Let what is queued be fetched as usual for up to ``drain_s`` seconds, then stop
        and pass what is left to the engine loop without KV (it recomputes)."""
        left = self._drain(drain_s)
        for adm in left:
            if adm.kv_fetch_source == "handoff" and self.handoffs is not None:
                self.handoffs.fallback(adm.request.request_id, "busy",
                                       "the worker stopped before its KV was fetched")
            adm.kv_fetch = None
        if left:
            self.inbox.put(left)


def resolve(adm: Admission) -> None:
    """Fetch ``adm``'s KV (the fetch never raises for the tier: it falls back) and set it."""
    assert adm.kv_fetch is not None, "an admission with nothing to fetch"
    kv = adm.kv_fetch()
    adm.kv, adm.kv_source = kv, adm.kv_fetch_source if kv is not None else ""
    adm.kv_fetch = None
