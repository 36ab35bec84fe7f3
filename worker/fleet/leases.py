"""Leases on in-flight request entries: renewed while we own them, handed back on drain.

A pending entry's idle time is its lease: a live worker resets it well inside
``lease_ms``; an entry idle for longer belongs to a dead worker and any reaper claims it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import redis
import structlog

from producer.wire.keys import GROUP
from worker.fleet.inflight import InflightTable
from worker.fleet.supervised import SupervisedThread

log = structlog.get_logger(__name__)

# Renew only entries this consumer still owns: XCLAIM alone would steal them back from a
# worker that claimed them meanwhile. JUSTID keeps the delivery count unchanged.
RENEW_SCRIPT = """
local renewed = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    renewed[#renewed + 1] = ARGV[i]
  end
end
return renewed
"""


class LeaseKeeper(SupervisedThread):
    """Renews every in-flight entry's lease; reports entries another worker took over."""

    def __init__(self, client: redis.Redis, worker_id: str, inflight: InflightTable,
                 lease_ms: int, on_lost: Callable[[str], None], **supervision: Any) -> None:
        # Three renewals per lease: one late renewal never lets an entry lapse.
        super().__init__("lease-keeper", worker_id=worker_id, interval_s=lease_ms / 3000,
                         **supervision)
        self.client = client
        self.inflight = inflight
        self.lease_ms = lease_ms
        self.on_lost = on_lost
        # A registered script reloads itself after NOSCRIPT (e.g. Redis restarted).
        self.renew = client.register_script(RENEW_SCRIPT)
        self.renewals = 0

    def tick(self) -> None:
        self.renew_all()

    def renew_all(self) -> None:
        by_stream: dict[str, dict[str, str]] = defaultdict(dict)
        for rid in self.inflight.ids():
            entry = self.inflight.get(rid)
            if entry is not None:
                by_stream[entry.stream][entry.entry_id] = rid
        for stream, entries in by_stream.items():
            renewed = self.renew(keys=[stream], args=[GROUP, self.worker_id, *entries])
            kept = {r.decode() if isinstance(r, bytes) else r for r in renewed}
            self.renewals += len(kept)
            for entry_id, rid in entries.items():
                if entry_id not in kept and rid in self.inflight:
                    log.warning("lease lost: another worker owns the request now",
                                request_id=rid)
                    self.on_lost(rid)


def hand_back(client: redis.Redis, worker_id: str, entries: list[tuple[str, str]],
              lease_ms: int) -> None:
    """Make our pending entries look expired so another worker claims them at once.

    Deleting the consumer would drop its pending entries from the group (lost requests);
    instead each entry's idle time is set past the lease.
    """
    by_stream: dict[str, list[str]] = defaultdict(list)
    for stream, entry_id in entries:
        by_stream[stream].append(entry_id)
    for stream, ids in by_stream.items():
        client.xclaim(stream, GROUP, worker_id, 0, ids, idle=10 * lease_ms, justid=True)
