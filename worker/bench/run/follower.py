"""Follow the output streams of a changing set of requests with one XREAD a round.

``Client.follow_many`` follows a fixed list; a benchmark adds requests while it reads, so
this keeps the same trackers (``OutputTracker``) in a set that grows and shrinks.

The bench's client shares the machine's cores with the worker it measures, and Redis's
CPU counts in the wire's cost per token (docs/redis.md), so the reads are paced: an XREAD
checks every stream it names, whether or not it has anything, and a poll per entry at a
GPU's rate (thousands of chunks a second) would cost Redis and this process more than the
worker's writes. A poll starts at least ``period_s`` after the last one and gets what every
stream got meanwhile; it names the streams that have begun (their chunks come each stream
interval) and only the oldest WAITING_PER_POLL of those with nothing yet; every SWEEP_S a
sweep names the next SWEEP_NAMES of the others, in turn (4,000 queued requests are not
checked 100 times a second, nor 16,000 four times a second). A reader sees each chunk at
most ``period_s`` late, and a first token at most SWEEP_S late where requests start out of
the order they were sent in (with more than SWEEP_NAMES others waiting, one sweep per
SWEEP_NAMES of them: requests that start out of order wait in queues that short).

With ``quiet_s`` (the stream interval less a margin: the workers write a stream's chunks
at most once an interval), a stream that just gave a chunk is not named again until
``quiet_s`` later: at a GPU's rate, an XREAD naming every decoding stream at every poll
spends most of its time on streams that cannot have anything yet (measured: ~0.35 µs of
Redis CPU a stream named, ~0.1 µs one not made yet, against 2-4 µs an entry read). With
the 2 ms margin the bench gives and polls every 5 ms, a W7 run named a decoding stream
1.16 times a chunk it read. A request's final can come sooner
than that after its last chunk (its last tokens go at once): it is seen up to ``quiet_s``
late, which lengthens that request's end-to-end time by as much, and no chunk gap.

Its XREAD goes through ``run_commands`` (hiredis packs it, and the reply is read raw, with
no dict per entry) and each entry's message goes to its tracker as it is.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from itertools import islice

import redis

from producer.client.client import FOLLOW_MANY_KEYS, READ_COUNT
from producer.client.stream_events import OutputTracker, StreamEvent
from producer.clock import SYSTEM_CLOCK, Clock
from producer.wire.keys import Keys
from producer.wire.protocol import entry_message
from worker.fleet.publishing.raw_pipeline import run_commands

# Seconds from one poll's start to the next's (see the module docstring).
POLL_PERIOD_S = 0.005
# Streams with nothing read yet that each poll names, oldest first; every SWEEP_S, the next
# SWEEP_NAMES of the others, in turn.
WAITING_PER_POLL = 8
SWEEP_S = 0.25
SWEEP_NAMES = 256


class StreamFollower:
    """Yields (request id, event) for every request added, until each has its final entry."""

    def __init__(self, client: redis.Redis, keys: Keys, period_s: float = POLL_PERIOD_S,
                 clock: Clock | None = None, quiet_s: float = 0.0) -> None:
        self.client = client
        self.keys = keys
        self.period_s = period_s
        self.quiet_s = quiet_s
        # Streams not named before then (their last chunk came less than quiet_s ago).
        self._quiet_until: dict[str, float] = {}
        self.clock = clock or SYSTEM_CLOCK
        self._trackers: dict[str, OutputTracker] = {}
        # Each request's stream key, made once: a poll of 64 streams would otherwise spend
        # most of its own time building and checking the same 64 key names again.
        self._key_of: dict[str, str] = {}
        self._by_key: dict[str, str] = {}
        # Requests with nothing read yet, in the order they were added (dicts keep it), and
        # those with something.
        self._waiting: dict[str, None] = {}
        self._started: dict[str, None] = {}
        self._last_poll: float | None = None
        self._next_sweep = 0.0
        # Waiting requests in the order sweeps name them (round robin; started ones drop out
        # as a sweep comes to them).
        self._to_sweep: deque[str] = deque()
        self._pause = threading.Event()  # never set: waited on for the period

    def add(self, request_id: str) -> None:
        key = self.keys.output(request_id)
        self._trackers[request_id] = OutputTracker()
        self._key_of[request_id] = key
        self._by_key[key] = request_id
        self._waiting[request_id] = None
        self._to_sweep.append(request_id)

    def __len__(self) -> int:
        return len(self._trackers)

    def poll(self, block_ms: int) -> list[tuple[str, StreamEvent]]:
        """What arrived since the last poll; waits up to ``block_ms`` for the first entry.

        More than FOLLOW_MANY_KEYS streams are read in several XREADs, only the first blocking.
        """
        if self._last_poll is not None:
            pause = self._last_poll + self.period_s - self.clock.monotonic()
            if pause > 0:
                self.clock.wait(self._pause, pause)
        now = self._last_poll = self.clock.monotonic()
        waiting = list(islice(self._waiting, WAITING_PER_POLL))
        if now >= self._next_sweep:
            waiting += self._sweep(set(waiting))
            self._next_sweep = now + SWEEP_S
        if self._quiet_until:
            self._quiet_until = {r: t for r, t in self._quiet_until.items() if t > now}
            ids = [rid for rid in self._started if rid not in self._quiet_until] + waiting
        else:
            ids = list(self._started) + waiting
        block_ms = self._block_ms(block_ms, now)
        events: list[tuple[str, StreamEvent]] = []
        for start in range(0, len(ids), FOLLOW_MANY_KEYS):
            group = ids[start:start + FOLLOW_MANY_KEYS]
            block = ("BLOCK", block_ms) if start == 0 else ()
            command = ("XREAD", "COUNT", READ_COUNT, *block, "STREAMS",
                       *(self._key_of[rid] for rid in group),
                       *(self._trackers[rid].last_id for rid in group))
            reply = run_commands(self.client, [command])[0]
            if isinstance(reply, Exception):
                raise reply
            # RESP3 answers a map of stream -> entries, RESP2 a list of pairs.
            for stream, entries in (reply.items() if isinstance(reply, dict) else reply or []):
                self._feed(stream, entries, events)
        return events

    def _block_ms(self, block_ms: int, now: float) -> int:
        """How long this poll's XREAD may wait: ``block_ms``, but no longer than until the
        first quiet stream may have its next chunk, nor than the next sweep where it has
        streams to name (a read that waits on the streams it named would not see theirs).
        Where every started stream is quiet at once (they all began in one step, as a batch
        does), waiting longer would make each of their chunks that late."""
        due = [*self._quiet_until.values()]
        if len(self._waiting) > WAITING_PER_POLL:
            due.append(self._next_sweep)
        if due:
            block_ms = min(block_ms, math.ceil((min(due) - now) * 1000))
        return max(1, block_ms)

    def _sweep(self, named: set[str]) -> list[str]:
        """The next SWEEP_NAMES waiting requests not in ``named`` (the oldest), in turn."""
        names: list[str] = []
        for _ in range(len(self._to_sweep)):
            if len(names) == SWEEP_NAMES:
                break
            rid = self._to_sweep.popleft()
            if rid in self._waiting:
                self._to_sweep.append(rid)
                if rid not in named:
                    names.append(rid)
        return names

    def _feed(self, stream: bytes, entries: list, events: list) -> None:
        rid = self._by_key[stream.decode()]
        if self._waiting.pop(rid, 0) is None:
            self._started[rid] = None
        tracker = self._trackers.get(rid)
        for entry_id, fields in entries:
            if tracker is None:
                break
            event = tracker.feed_message(entry_id, entry_message(fields))
            if event is not None:
                events.append((rid, event))
                if self.quiet_s:
                    self._quiet_until[rid] = self._last_poll + self.quiet_s
            if tracker.done:
                del self._trackers[rid]
                self._started.pop(rid, None)
                self._quiet_until.pop(rid, None)
                del self._by_key[self._key_of.pop(rid)]
                tracker = None
