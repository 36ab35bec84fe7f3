"""Follow the output streams of a changing set of requests with one XREAD a round.

``Client.follow_many`` follows a fixed list; a benchmark adds requests while it reads, so
this keeps the same trackers (``OutputTracker``) in a set that grows and shrinks.
"""

from __future__ import annotations

import redis

from producer.client import FOLLOW_MANY_KEYS, READ_COUNT
from producer.stream_events import OutputTracker, StreamEvent
from producer.wire.keys import Keys


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
            streams = {self._key_of[rid]: self._trackers[rid].last_id for rid in group}
            reply = self.client.xread(streams, count=READ_COUNT,
                                      block=max(1, block_ms) if start == 0 else None)
            for stream, entries in reply or []:
                self._feed(stream, entries, events)
        return events

    def _feed(self, stream: bytes | str, entries: list, events: list) -> None:
        rid = self._by_key[stream.decode() if isinstance(stream, bytes) else stream]
        tracker = self._trackers.get(rid)
        for entry_id, fields in entries:
            if tracker is None:
                break
            event = tracker.feed(entry_id, fields)
            if event is not None:
                events.append((rid, event))
            if tracker.done:
                del self._trackers[rid]
                del self._by_key[self._key_of.pop(rid)]
                tracker = None
