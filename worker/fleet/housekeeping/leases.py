"""Leases on in-flight request entries: renewed while we own them, handed back on drain.

A pending entry's idle time is its lease: a live worker resets it well inside
``lease_ms``; an entry idle for longer belongs to a dead worker and any reaper claims it.
The keeper also looks at the watch keys of the requests whose producers tied them to their
life (producer/client/watch.py), every WATCH_CHECK_S: a request whose watch is missing at
two looks WATCH_GRACE_S apart is cancelled, since nobody is left to read it (one look is not
enough: a Redis that restarted or failed over may have dropped every watch key at once,
and live producers set theirs again within a renewal).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import redis
import structlog

from producer.wire.keys import GROUP, Keys, as_text
from worker.fleet.inflight import InflightTable
from worker.fleet.publishing.ownership import OwnedEntries
from worker.fleet.supervised import SupervisedThread

log = structlog.get_logger(__name__)

# How often the keeper looks at watch keys (leases are renewed at their own pace), and how
# long a watch must stay missing before its requests are cancelled.
WATCH_CHECK_S = 2.5
WATCH_GRACE_S = 5.0

class LeaseKeeper(SupervisedThread):
    """Renews every in-flight entry's lease; reports entries another worker took over."""

    def __init__(self, client: redis.Redis, worker_id: str, inflight: InflightTable,
                 lease_ms: int, on_lost: Callable[[str], None],
                 keys: Keys | None = None,
                 on_orphaned: Callable[[str], None] | None = None,
                 **supervision: Any) -> None:
        # Three renewals per lease: one late renewal never lets an entry lapse. The loop
        # turns at least every WATCH_CHECK_S for the watches.
        super().__init__("lease-keeper", worker_id=worker_id,
                         interval_s=min(lease_ms / 3000, WATCH_CHECK_S), **supervision)
        self.renew_every_s = lease_ms / 3000
        self._next_renewal = -float("inf")
        self.client = client
        self.inflight = inflight
        self.lease_ms = lease_ms
        self.on_lost = on_lost
        # Renews only entries still ours: XCLAIM alone would steal them back from a worker
        # that claimed them meanwhile.
        self.owned = OwnedEntries(client, worker_id)
        self.renewals = 0
        # Watch keys are looked at where ``keys`` and ``on_orphaned`` are given.
        self.keys = keys
        self.on_orphaned = on_orphaned
        # Requests cancelled because their producer's watch lapsed (ids: cancelled once).
        self.orphaned = 0
        self._orphaned_ids: set[str] = set()
        # Watch id -> when it was first found missing (on the keeper's clock).
        self._missing_since: dict[str, float] = {}

    def tick(self) -> None:
        now = self.clock.monotonic()
        if now >= self._next_renewal:
            self.renew_all()  # a failure leaves it due: the retry renews at once
            self._next_renewal = now + self.renew_every_s
        self.check_watches()

    @property
    def watches_missing(self) -> int:
        """Watches found missing, not yet for WATCH_GRACE_S (their requests go next)."""
        return len(self._missing_since)

    def check_watches(self) -> None:
        """Cancel every in-flight request whose producer's watch key has been gone for
        WATCH_GRACE_S (seen missing at two looks at least that far apart)."""
        if self.keys is None or self.on_orphaned is None:
            return
        watched: dict[str, list[str]] = defaultdict(list)
        for rid in self.inflight.ids():
            if (e := self.inflight.get(rid)) is not None and e.watch is not None:
                watched[e.watch].append(rid)
        self._orphaned_ids &= set(self.inflight.ids())
        if not watched:
            return
        pipe = self.client.pipeline(transaction=False)
        for watch in watched:
            pipe.exists(self.keys.watch(watch))
        try:
            found = pipe.execute()
        except redis.exceptions.NoPermissionError as exc:
            # A worker ACL from before watches: serve on, without cancelling orphans.
            log.warning("this worker's Redis user may not read watch keys ({ns}:watch:*): "
                        "requests whose producer died are not cancelled", error=str(exc))
            self.on_orphaned = None
            return
        now = self.clock.monotonic()
        self._missing_since = {w: t for w, t in self._missing_since.items() if w in watched}
        for (watch, rids), alive in zip(watched.items(), found, strict=True):
            if alive:
                self._missing_since.pop(watch, None)
                continue
            since = self._missing_since.setdefault(watch, now)
            if now - since < WATCH_GRACE_S:
                continue
            for rid in rids:
                if rid in self.inflight and rid not in self._orphaned_ids:
                    self._orphaned_ids.add(rid)
                    log.info("request cancelled: its producer's watch lapsed",
                             request_id=rid, watch=watch)
                    self.orphaned += 1
                    self.on_orphaned(rid)

    def renew_all(self) -> None:
        # Each entry and the requests served for it (a request's choices share its entry).
        held: dict[tuple[str, str], list[str]] = {}
        for rid in self.inflight.ids():
            if (e := self.inflight.get(rid)) is not None:
                held.setdefault((e.stream, e.entry_id), []).append(rid)
        if not held:
            return
        kept = self.owned.renew(list(held))
        self.renewals += len(kept)
        for entry, rids in held.items():
            for rid in rids if entry not in kept else ():
                if rid in self.inflight:
                    log.warning("lease lost: another worker owns the request now",
                                request_id=rid)
                    self.on_lost(rid)


def hand_back(client: redis.Redis, worker_id: str, entries: list[tuple[str, str]],
              lease_ms: int) -> None:
    """Make our pending entries look expired so another worker claims them at once.

    Deleting the consumer would drop its pending entries from the group (lost requests);
    instead each entry's idle time is set past the lease. A hand-back is not a failure: the
    delivery count is set one lower, so the claim that follows (which counts one) leaves it
    where it was, and a request drained through many restarts never looks like poison.
    """
    by_stream: dict[str, list[str]] = defaultdict(list)
    for stream, entry_id in entries:
        by_stream[stream].append(entry_id)
    for stream, ids in by_stream.items():
        counts = {as_text(p["message_id"]): int(p["times_delivered"])
                  for p in client.xpending_range(stream, GROUP, "-", "+", 10_000,
                                                 consumername=worker_id)}
        # Only entries still ours (nobody claimed them meanwhile).
        release(client, worker_id, stream,
                {eid: max(0, counts[eid] - 1) for eid in ids if eid in counts}, lease_ms)


def release(client: redis.Redis, worker_id: str, stream: str, counts: dict[str, int],
            lease_ms: int) -> None:
    """Make entries claimable at once (idle past the lease), their delivery counts set to
    ``counts`` (entry id -> count)."""
    for eid, count in counts.items():
        client.xclaim(stream, GROUP, worker_id, 0, [eid], idle=10 * lease_ms,
                      retrycount=count, justid=True)

