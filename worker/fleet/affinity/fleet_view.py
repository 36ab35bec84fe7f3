"""What a worker knows of the other workers with affinity lanes: who has lanes, who lives,
who has room, and how many prefixes each took on."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import redis

from producer.client.models import LIVE_STATUSES
from producer.clock import SYSTEM_CLOCK, Clock
from producer.wire.keys import Keys, as_text

# Seconds a view is trusted: a worker that died or began draining is seen within this
# (producers see it within their model check's 5 s; requests they still send its way are
# taken over as soon as this view sees it gone).
VIEW_TTL_S = 1.0
# Prefixes a worker may own beyond the fewest a peer with room owns before it yields new
# ones to that peer.
OWNED_MARGIN = 1


@dataclass(frozen=True)
class Snapshot:
    """One reading of the fleet, replaced whole (the intake and the reaper share it)."""

    members: tuple[str, ...] = ()
    # Members that take requests and read their affinity lanes (a member restarted with
    # --no-affinity, draining or gone is not: its lanes are taken over at once).
    live: frozenset[str] = frozenset()
    # Live members whose heartbeat said they had room (a full worker says so at once).
    with_room: frozenset[str] = frozenset()
    # Prefixes each worker became the owner of (``{ns}:affinity:{{model}}:owned``).
    owned: dict[str, int] = field(default_factory=dict)


class FleetView:
    """The workers with affinity lanes of one model: which of them take requests, which had
    room at their last heartbeat, and how many prefixes each became the owner of.

    Read on demand, at most every VIEW_TTL_S of ``clock``: one round trip of SMEMBERS and
    HGETALL, then one HMGET of each member's heartbeat.
    """

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.client, self.keys, self.model, self.worker_id = client, keys, model, worker_id
        self.clock = clock
        self.now = Snapshot()
        self._read_at: float | None = None
        self._lock = threading.Lock()  # one reader of Redis at a time

    def refresh(self, force: bool = False) -> None:
        with self._lock:
            now = self.clock.monotonic()
            if not force and self._read_at is not None and now - self._read_at < VIEW_TTL_S:
                return
            self.now = self._read()
            self._read_at = now

    def _read(self) -> Snapshot:
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.smembers(self.keys.affinity_lanes(self.model))
            pipe.hgetall(self.keys.affinity_owned(self.model))
            raw_members, raw_owned = pipe.execute()
        except redis.exceptions.NoPermissionError:  # a user from before affinity: none
            return Snapshot()
        members = sorted({as_text(m) for m in raw_members})
        pipe = self.client.pipeline(transaction=False)
        for member in members:
            pipe.hmget(self.keys.worker(member), "status", "model", "affinity", "room")
        live, room = set(), set()
        for member, fields in zip(members, pipe.execute() if members else [], strict=True):
            status, model, affinity, free = (None if v is None else as_text(v) for v in fields)
            if status in LIVE_STATUSES and model == self.model and affinity == "1":
                live.add(member)
                if free not in (None, "", "0"):
                    room.add(member)
        return Snapshot(tuple(members), frozenset(live), frozenset(room),
                        {as_text(k): int(v) for k, v in raw_owned.items()})

    def others(self) -> tuple[str, ...]:
        """Every other worker with affinity lanes, in name order."""
        return tuple(m for m in self.now.members if m != self.worker_id)

    def is_live(self, worker_id: str) -> bool:
        return worker_id in self.now.live

    def has_room(self, worker_id: str) -> bool:
        return worker_id in self.now.with_room

    def peer_with_room(self) -> bool:
        """Whether another live worker had room (neither full nor busy) at its last word."""
        return bool(self.now.with_room - {self.worker_id})

    def lighter_with_room(self, owned: int) -> bool:
        """Whether another live worker with room owns more than OWNED_MARGIN fewer prefixes
        than ``owned``: a new prefix should rather go to it. (The counts lag by up to a
        view: a wrong answer only changes who reads first.)"""
        snap = self.now
        return any(snap.owned.get(w, 0) + OWNED_MARGIN < owned for w in snap.with_room
                   if w != self.worker_id)

    def fewest_owned(self) -> int:
        """The fewest prefixes a live worker other than this one owns (0: none lives)."""
        snap = self.now
        return min((snap.owned.get(w, 0) for w in snap.live if w != self.worker_id),
                   default=0)
