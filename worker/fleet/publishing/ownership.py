"""Acting on request entries only while this worker still owns them: renew, acknowledge.

XCLAIM and XACK alone do not check the owner. A worker whose lease lapsed would steal an
entry back from the worker that claimed it (XCLAIM), or drop it from that worker's pending
list (XACK), which then loses its lease on a request it is still serving. The script looks
at each entry's owner first. It touches one key (the request stream), so it runs unchanged
on Redis Cluster.
"""

from __future__ import annotations

from collections import defaultdict

import redis

from producer.wire.keys import GROUP

# ARGV: group, consumer, "renew" | "ack", entry ids. JUSTID keeps the delivery count as it is.
IF_OWNER_SCRIPT = """
local done = {}
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    if ARGV[3] == 'renew' then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    else
      redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
    end
    done[#done + 1] = ARGV[i]
  end
end
return done
"""


class OwnedEntries:
    """Renews or acknowledges the entries ``worker_id`` owns among those it is given."""

    def __init__(self, client: redis.Redis, worker_id: str) -> None:
        self.worker_id = worker_id
        # A registered script reloads itself after NOSCRIPT (e.g. Redis restarted).
        self._script = client.register_script(IF_OWNER_SCRIPT)

    def renew(self, entries: list[tuple[str, str]]) -> set[tuple[str, str]]:
        """Reset the idle time (the lease) of each owned (stream, entry id); returns those."""
        return self._apply("renew", entries)

    def ack(self, entries: list[tuple[str, str]]) -> set[tuple[str, str]]:
        """XACK each owned (stream, entry id); returns those acknowledged."""
        return self._apply("ack", entries)

    def _apply(self, op: str, entries: list[tuple[str, str]]) -> set[tuple[str, str]]:
        by_stream: dict[str, list[str]] = defaultdict(list)
        for stream, entry_id in entries:
            by_stream[stream].append(entry_id)
        done: set[tuple[str, str]] = set()
        for stream, ids in by_stream.items():
            got = self._script(keys=[stream], args=[GROUP, self.worker_id, op, *ids])
            done |= {(stream, e.decode() if isinstance(e, bytes) else e) for e in got}
        return done
