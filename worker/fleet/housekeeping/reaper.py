"""The reaper thread: claims entries whose lease lapsed (their worker died) and resumes them.

Also runs at start-up, so a worker restarted under the same name takes back its own work.
Entries delivered more often than ``max_deliveries`` are poison: dead-lettered, not retried.
"""

from __future__ import annotations

from typing import Any

import redis
import structlog

from producer.client.queues import BLOCKED_HINT, lane_blocked, trim_request_stream
from producer.wire.keys import GROUP, Keys, as_text
from producer.wire.protocol import FIELD, GenerationRequest, ProtocolError, declared_choices
from producer.wire.validation import choice_id
from worker.fleet.affinity.pruning import LanePruner
from worker.fleet.housekeeping.consumers import ConsumerSweeper, prune_worker_set
from worker.fleet.housekeeping.leases import release
from worker.fleet.housekeeping.old_lanes import OldLanes
from worker.fleet.inflight import InflightTable
from worker.fleet.intake.intake import Intake
from worker.fleet.intake.resume import take_over
from worker.fleet.supervised import SupervisedThread

log = structlog.get_logger(__name__)


# A request delivered this often already (its workers died holding it) is a suspect: the
# next worker serves it alone. It is dead-lettered once over the delivery limit and after
# CONVICTING_KILLS runs alone that each ended with a dead worker. The count of runs alone
# is kept this long.
SUSPECT_DELIVERIES = 2
CONVICTING_KILLS = 2
ISOLATION_MEMORY_S = 24 * 3600
# A consumer idle this many leases with nothing pending is a dead worker's: removed.
DEAD_CONSUMER_LEASES = 10
# XAUTOCLAIM calls one tick may make while following the cursor through the pending list.
MAX_SCANS_PER_TICK = 16
# XAUTOCLAIM ... JUSTID, returning its raw reply: [cursor, ids] (6.2) or [cursor, ids, deleted]
# (7). redis-py's own parsing of JUSTID replies drops the cursor.
AUTOCLAIM_SCRIPT = """
return redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5],
                  'JUSTID')
"""


class Reaper(SupervisedThread):
    """Every ``interval_s``, claims up to the room left of entries idle past the lease.

    It also trims the request streams now and then: only entries below the oldest
    pending one go, so nothing undelivered or in flight is ever removed.
    """

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, intake: Intake,
                 inflight: InflightTable, lease_ms: int, max_deliveries: int,
                 interval_s: float, housekeeping_interval_s: float,
                 **supervision: Any) -> None:
        super().__init__("reaper", worker_id=worker_id, interval_s=interval_s, **supervision)
        # Where it reads and claims, the requests it hands back or tracks, and the lease rules.
        self.client, self.keys, self.intake, self.inflight = client, keys, intake, inflight
        self.lease_ms, self.max_deliveries = lease_ms, max_deliveries
        self.claimed = 0
        self.isolated = 0  # suspects served alone
        self._saw_suspect = False
        self._cursors: dict[str, str] = {}  # per stream: where the next pending scan starts
        self._autoclaim_script = client.register_script(AUTOCLAIM_SCRIPT)
        # Consumers of workers gone for ten leases, holding nothing, leave the group.
        self.sweeper = ConsumerSweeper(client, worker_id, DEAD_CONSUMER_LEASES * lease_ms)
        self.housekeeping_interval_s = housekeeping_interval_s
        # Every housekeeping_interval_s: trim served entries, sweep dead consumers, prune
        # the worker set, check for lanes closed to new requests, answer requests on the
        # old-layout lane keys (tick).
        self._next_housekeeping = self.clock.monotonic() + housekeeping_interval_s
        # Request streams an entry at the largest id closed to new requests (check_lanes).
        self.blocked_lanes: list[str] = []
        # Requests added to the model's lane keys of the old layout, answered (old_lanes.py).
        self.old_lanes = OldLanes(client, keys, intake.model, worker_id,
                                  intake.publisher.output_ttl_s)
        # The model's workers with affinity lanes (worker/fleet/affinity/), as the intake
        # sees them; a live worker's lanes are looked at every lease / 3 (a request a taker
        # died holding lapses a lease after), a gone or draining one's every tick (what it
        # handed back is claimable at once).
        self.view = intake.fleet_view
        self._next_live_lanes = self.clock.monotonic()
        self.pruner = LanePruner(client, keys, intake.model, self.view, self.clock)

    def tick(self) -> None:
        # A lost group (NOGROUP) is the intake's to recreate; until then this tick fails and
        # the supervisor retries it, like any other refusal.
        self._saw_suspect = False
        # Other workers' affinity lanes too: a worker that took a request from one and died
        # left it pending there, maybe after that lane's worker died too.
        others = self.other_lanes()
        for stream in self.intake.streams:
            self.reap(stream)
        for stream in others:
            try:
                self.reap(stream)
            except redis.ResponseError as exc:  # a worker listed before its lanes exist
                if "NOGROUP" not in str(exc):
                    raise
        # A suspect waits for an empty worker: stop reading new work until one is taken.
        self.inflight.hold(self._saw_suspect and self.inflight.alone is None)
        if self.clock.monotonic() >= self._next_housekeeping:
            self._next_housekeeping = self.clock.monotonic() + self.housekeeping_interval_s
            for stream in self.intake.streams:
                trim_request_stream(self.client, stream)
                self.sweeper.sweep(stream)
            for stream in others:  # (served entries of gone workers' lanes, too)
                trim_request_stream(self.client, stream)
            if self.intake.takeover is not None:
                self.pruner.prune()
            prune_worker_set(self.client, self.keys)
            self.check_lanes()
            self.old_lanes.answer()

    def other_lanes(self) -> list[str]:
        """The affinity lanes of the model's other workers to look at now (none for a
        decode worker): a gone or draining worker's each tick, a live one's every lease / 3."""
        if self.intake.takeover is None:
            return []
        self.view.refresh()
        now = self.clock.monotonic()
        every = now >= self._next_live_lanes
        if every:
            self._next_live_lanes = now + self.lease_ms / 3000
        return [stream for worker in self.view.others()
                if every or not self.view.is_live(worker)
                for stream in self.keys.affinity_lanes_of(self.intake.model, worker)]

    def check_lanes(self) -> list[str]:
        """Note (and log, when it changes) the lanes that take no new request."""
        blocked = [s for s in self.intake.streams if lane_blocked(self.client, s)]
        if blocked != self.blocked_lanes:
            for stream in blocked:
                log.error("request lane blocked: its last entry id is the largest possible, so "
                          "no producer can add a request to it", stream=stream,
                          remedy=BLOCKED_HINT)
            self.blocked_lanes = blocked
        return blocked

    def reap(self, stream: str) -> int:
        """Claim and resume lapsed entries of one stream; returns how many were claimed.

        The scan of the pending list goes on from where the last one stopped (XAUTOCLAIM's
        cursor), so lapsed entries behind many live ones are reached too.
        """
        claimed = 0
        for _ in range(MAX_SCANS_PER_TICK):
            room = self.inflight.room()
            if room == 0:
                break
            cursor, ids = self._autoclaim(stream, self._cursors.get(stream, "0-0"), room)
            self._cursors[stream] = cursor
            claimed += self._take(stream, ids)
            if self._saw_suspect:
                # Released for now: the next scan starts over, so it is found again soon.
                self._cursors[stream] = "0-0"
                break
            if cursor == "0-0":  # the whole pending list was scanned
                break
        return claimed

    def _autoclaim(self, stream: str, start: str, count: int) -> tuple[str, list[str]]:
        """(next cursor, ids claimed): entries idle past the lease from ``start`` on."""
        # JUSTID: cheap, and it leaves delivery counts alone (the XCLAIM below counts them).
        reply = self._autoclaim_script(keys=[stream], args=[GROUP, self.worker_id,
                                                            self.lease_ms, start, count])
        return as_text(reply[0]), [as_text(e) for e in reply[1]]

    def _take(self, stream: str, ids: list[str]) -> int:
        # An entry this worker is serving lapsed while it could not reach Redis (an outage
        # longer than the lease): the claim renewed it; nothing else to do.
        ours = {e.entry_id for rid in self.inflight.ids()
                if (e := self.inflight.get(rid)) is not None and e.stream == stream}
        ids = [eid for eid in ids if eid not in ours]
        if not ids:
            return 0
        # Delivery counts before this claim (JUSTID did not count it).
        counts = {eid: self._deliveries(stream, eid) for eid in ids}
        suspects = [eid for eid in ids if counts[eid] >= SUSPECT_DELIVERIES]
        alone = None
        if suspects:
            # Died with workers twice or more: served alone, so that it dies alone if it is
            # what kills them, and innocent requests batched with it stop dying too.
            self._saw_suspect = True
            if len(self.inflight) == 0 and self.inflight.alone is None:
                alone = suspects[0]
            take = [alone] if alone else []
        else:
            take = ids
        left = {eid: counts[eid] for eid in ids if eid not in take}
        if left:  # claimable again at once, their counts as they were
            release(self.client, self.worker_id, stream, left, self.lease_ms)
        if not take:
            return 0
        claimed = self.client.xclaim(stream, GROUP, self.worker_id, 0, take)  # counts one
        found = {as_text(eid): fields for eid, fields in claimed if eid is not None}
        for eid in take:
            fields = found.get(eid)
            if fields is None:  # trimmed away: nothing left to serve
                self.client.xack(stream, GROUP, eid)
                continue
            self._resume(stream, eid, fields, counts[eid] + 1, alone=eid == alone)
        self.claimed += len(take)
        return len(take)

    def _deliveries(self, stream: str, entry_id: str) -> int:
        info = self.client.xpending_range(stream, GROUP, min=entry_id, max=entry_id, count=1)
        return int(info[0]["times_delivered"]) if info else 0

    def _resume(self, stream: str, entry_id: str, fields: dict, deliveries: int,
                alone: bool) -> None:
        request_id, choices = _request_id(fields)
        # Its streams (one a choice) taken over first: nothing its earlier worker still
        # sends can land. Not where this worker serves a request of that id (another entry
        # of it: the intake refuses this one as a duplicate), whose writes the take-over
        # would refuse.
        if request_id is None or self.inflight.serving(request_id, choices) is not None:
            published = None
        else:
            published = [take_over(self.client, self.keys, choice_id(request_id, i),
                                   self.intake.publisher.output_ttl_s)
                         for i in range(choices)]
        if published is not None and all(p.finished for p in published):
            self.client.xack(stream, GROUP, entry_id)  # its worker died between final and ack
            return
        num = len(published[0].token_ids) if published else 0
        if request_id is None:  # unreadable: the intake dead-letters it
            alone = False
        if alone:
            # Its earlier runs alone each ended with a dead worker (else it was acknowledged).
            runs_alone = int(self.client.get(self.keys.isolated(request_id)) or 0)
            if runs_alone >= CONVICTING_KILLS and deliveries > self.max_deliveries:
                reason = (f"delivered {deliveries} times (limit {self.max_deliveries}), "
                          f"{runs_alone} of them alone, each ending with its worker dead: "
                          "it is what kills the workers that take it")
                log.error("poison request dead-lettered", request_id=request_id,
                          entry_id=entry_id, deliveries=deliveries, runs_alone=runs_alone)
                self.intake.reject(stream, entry_id, reason, request_id, fields.get(FIELD),
                                   published=published, choices=choices)
                return
        log.info("resuming a claimed request", request_id=request_id, entry_id=entry_id,
                 published_tokens=num, deliveries=deliveries, alone=alone)
        admitted = self.intake.accept(stream, entry_id, fields, published, alone=alone)
        if not admitted:
            return
        if alone:  # counted once it really runs alone
            pipe = self.client.pipeline(transaction=True)
            pipe.incr(self.keys.isolated(request_id))
            pipe.expire(self.keys.isolated(request_id), ISOLATION_MEMORY_S)
            pipe.execute()
            self.isolated += 1
        self.intake.hand_over(admitted, self.client)



def _request_id(fields: dict) -> tuple[str | None, int]:
    """The entry's request id (None where it names none) and its number of choices."""
    try:
        req = GenerationRequest.decode(fields.get(FIELD))
    except ProtocolError as exc:
        return exc.request_id, declared_choices(fields.get(FIELD))
    return req.request_id, req.params.n
