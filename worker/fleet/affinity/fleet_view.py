"""What a worker knows of the other workers with affinity lanes: who has lanes, who lives,
who has room, and how many prefixes each took on."""

from __future__ import annotations

import threading

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


class FleetView:
    """The workers with affinity lanes of one model: which of them take requests, which had
    room at their last heartbeat, and how many prefixes each became the owner of.

    Read on demand, at most every VIEW_TTL_S of ``clock`` (the intake and the reaper share
    one): one round trip of SMEMBERS and HGETALL, then one HMGET of each member's heartbeat.
    """

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.client, self.keys, self.model, self.worker_id = client, keys, model, worker_id
        self.clock = clock
        self.members: tuple[str, ...] = ()
        self.live: frozenset[str] = frozenset()
        # Live workers whose last heartbeat said they had room for more requests.
        self.with_room: frozenset[str] = frozenset()
        # Prefixes each worker became the owner of (``{ns}:affinity:{{model}}:owned``).
        self.owned: dict[str, int] = {}
        self._read_at: float | None = None
        self._lock = threading.Lock()

    def refresh(self, force: bool = False) -> None:
        with self._lock:
            now = self.clock.monotonic()
            if not force and self._read_at is not None and now - self._read_at < VIEW_TTL_S:
                return
            try:
                pipe = self.client.pipeline(transaction=False)
                pipe.smembers(self.keys.affinity_lanes(self.model))
                pipe.hgetall(self.keys.affinity_owned(self.model))
                raw_members, raw_owned = pipe.execute()
            except redis.exceptions.NoPermissionError:  # a user from before affinity: none
                raw_members, raw_owned = set(), {}
            members = sorted({as_text(m) for m in raw_members})
            pipe = self.client.pipeline(transaction=False)
            for member in members:
                pipe.hmget(self.keys.worker(member), "status", "model", "room")
            live, room = set(), set()
            for member, (status, model, free) in zip(
                    members, pipe.execute() if members else [], strict=True):
                if status is not None and as_text(status) in LIVE_STATUSES \
                        and model is not None and as_text(model) == self.model:
                    live.add(member)
                    if free is not None and as_text(free) not in ("", "0"):
                        room.add(member)
            self.members, self.live, self.with_room = (tuple(members), frozenset(live),
                                                       frozenset(room))
            self.owned = {as_text(k): int(v) for k, v in raw_owned.items()}
            self._read_at = now

    def others(self) -> tuple[str, ...]:
        """Every other worker with affinity lanes, in name order."""
        return tuple(m for m in self.members if m != self.worker_id)

    def is_live(self, worker_id: str) -> bool:
        return worker_id in self.live

    def lighter_with_room(self, owned: int) -> bool:
        """Whether another live worker with room owns more than OWNED_MARGIN fewer prefixes
        than ``owned``: a new prefix should rather go to it. (The counts lag by up to a
        view: a wrong answer only changes who reads first.)"""
        return any(self.owned.get(w, 0) + OWNED_MARGIN < owned for w in self.with_room
                   if w != self.worker_id)
