"""What a worker knows of the other workers with affinity lanes: who has lanes, who lives."""

from __future__ import annotations

import redis

from producer.client.models import LIVE_STATUSES
from producer.clock import SYSTEM_CLOCK, Clock
from producer.wire.keys import Keys, as_text

# Seconds a view is trusted: a worker that died or began draining is seen within this
# (producers see it within their model check's 5 s; requests they still send its way are
# taken over as soon as this view sees it gone).
VIEW_TTL_S = 1.0


class FleetView:
    """The workers with affinity lanes of one model, and which of them take requests.

    Read on demand, at most every VIEW_TTL_S of ``clock``: one SMEMBERS and one HMGET of
    each member's heartbeat, in one round trip after the first.
    """

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.client, self.keys, self.model, self.worker_id = client, keys, model, worker_id
        self.clock = clock
        self.members: tuple[str, ...] = ()
        self.live: frozenset[str] = frozenset()
        self._read_at: float | None = None

    def refresh(self, force: bool = False) -> None:
        now = self.clock.monotonic()
        if not force and self._read_at is not None and now - self._read_at < VIEW_TTL_S:
            return
        try:
            members = sorted({as_text(m) for m in self.client.smembers(
                self.keys.affinity_lanes(self.model))})
        except redis.exceptions.NoPermissionError:  # a user from before affinity: none
            members = []
        pipe = self.client.pipeline(transaction=False)
        for member in members:
            pipe.hmget(self.keys.worker(member), "status", "model")
        live = set()
        for member, (status, model) in zip(members, pipe.execute() if members else [],
                                            strict=True):
            if status is not None and as_text(status) in LIVE_STATUSES \
                    and model is not None and as_text(model) == self.model:
                live.add(member)
        self.members, self.live, self._read_at = tuple(members), frozenset(live), now

    def others(self) -> tuple[str, ...]:
        """Every other worker with affinity lanes, in name order."""
        return tuple(m for m in self.members if m != self.worker_id)

    def is_live(self, worker_id: str) -> bool:
        return worker_id in self.live
