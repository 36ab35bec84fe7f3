"""Follow the output streams of a changing set of requests with one XREAD a round.

``Client.follow_many`` follows a fixed list; a benchmark adds requests while it reads, so
this keeps the same trackers (``OutputTracker``) in a set that grows and shrinks.

The bench's client shares the machine's cores with the worker it measures, so its CPU is
the worker's loss: its XREAD goes through ``run_commands`` (hiredis packs it, and the reply
is read raw, with no dict per entry) and each entry's message goes to its tracker as it
is. A 64-stream poll costs ~0.6 ms of CPU this way, against ~0.95 ms through redis-py's
``xread``.
"""

from __future__ import annotations

import redis

from producer.client.client import FOLLOW_MANY_KEYS, READ_COUNT
from producer.client.stream_events import OutputTracker, StreamEvent
from producer.wire.keys import Keys
from producer.wire.protocol import FIELD, ProtocolError
from worker.fleet.publishing.raw_pipeline import run_commands


class StreamFollower:
    """Yields (request id, event) for every request added, until each has its final entry."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._trackers: dict[str, OutputTracker] = {}
        # Each request's stream key, made once: a poll of 64 streams would otherwise spend
        # most of its own time building and checking the same 64 key names again.
        self._key_of: dict[str, str] = {}
        self._by_key: dict[str, str] = {}

    def add(self, request_id: str) -> None:
        key = self.keys.output(request_id)
        self._trackers[request_id] = OutputTracker()
        self._key_of[request_id] = key
        self._by_key[key] = request_id

    def __len__(self) -> int:
        return len(self._trackers)

    def poll(self, block_ms: int) -> list[tuple[str, StreamEvent]]:
        """What arrived since the last poll; waits up to ``block_ms`` for the first entry.

        More than FOLLOW_MANY_KEYS streams are read in several XREADs, only the first blocking.
        """
        ids = list(self._trackers)
        events: list[tuple[str, StreamEvent]] = []
        for start in range(0, len(ids), FOLLOW_MANY_KEYS):
            group = ids[start:start + FOLLOW_MANY_KEYS]
            block = ("BLOCK", max(1, block_ms)) if start == 0 else ()
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

    def _feed(self, stream: bytes, entries: list, events: list) -> None:
        rid = self._by_key[stream.decode()]
        tracker = self._trackers.get(rid)
        for entry_id, fields in entries:
            if tracker is None:
                break
            event = tracker.feed_message(entry_id, _message(fields))
            if event is not None:
                events.append((rid, event))
            if tracker.done:
                del self._trackers[rid]
                del self._by_key[self._key_of.pop(rid)]
                tracker = None


def _message(fields: list[bytes]) -> bytes:
    """The message field of a raw entry ([field, value, ...]); ProtocolError without one."""
    if len(fields) == 2 and fields[0] == FIELD:  # every output entry: one field
        return fields[1]
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == FIELD:
            return fields[i + 1]
    raise ProtocolError("entry has no message field")
