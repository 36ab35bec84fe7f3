"""Advertising the prefixes a worker holds: each affinity key of the requests it serves
names it in the owners' hashes, unless it took the request from a live worker's lane."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import redis

from producer.affinity.routing import OWNER_GENERATION_S, generation
from producer.clock import SYSTEM_CLOCK, Clock
from producer.wire.keys import Keys
from worker.fleet.affinity.fleet_view import FleetView
from worker.fleet.messages import Admission

# Keys this worker remembers having advertised, with the generation it last wrote each in
# (a document's later questions cost nothing until the generation turns).
REMEMBERED_KEYS = 65_536


class Advertiser:
    """Names this worker as the owner of its requests' prefixes: one HSET of every new key
    of a read into the owners' hash of now's generation and one into the next's
    (``{ns}:affinity:{model}:owners:{generation}``), and one HINCRBY of the prefixes new to
    it. A key it wrote in this generation costs nothing; one written before is written
    again, at most once a generation.

    A request read from this worker's own lane or the shared lane, or taken from the lane
    of a worker that is gone or draining, names this worker (the latest worker to compute a
    prefix holds it freshest); one taken from a live worker that was busy leaves the keys
    to that worker, which holds the prefix still.
    """

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str,
                 view: FleetView, clock: Clock = SYSTEM_CLOCK) -> None:
        self.client, self.keys, self.model, self.worker_id = client, keys, model, worker_id
        self.view, self.clock = view, clock
        self.advertised = 0  # keys written (new or renewed)
        # Prefixes this worker became the owner of (the deepest key of a request), counted
        # in ``{ns}:affinity:{{model}}:owned`` too: new prefixes go to the workers with fewest.
        self.owned = 0
        self._written: OrderedDict[str, int] = OrderedDict()  # key -> generation written
        self._expiring: set[int] = set()  # generations whose hash this worker set to expire
        self._last_written: int | None = None  # the generation of its last write

    def join(self) -> None:
        """Start this worker's count of owned prefixes at the fewest a live worker has (a
        worker that joins late takes its share of new prefixes, not all of them until it
        caught up)."""
        # (again after Redis lost its data: what it wrote, and the hashes' expiry, are gone)
        self._written.clear()
        self._expiring.clear()
        self.view.refresh(force=True)
        self.owned = self.view.fewest_owned()
        self.client.hset(self.keys.affinity_owned(self.model), self.worker_id, self.owned)

    def generation(self) -> int:
        """The owners' generation this worker writes now (its heartbeat names it)."""
        return generation(self.clock.time())

    def owns_lately(self) -> bool:
        """Whether a producer may still find this worker the owner of a key it wrote (in
        this life: one read in the generation before can be read through this one, by a
        producer whose view of the generation is a turn behind, one more)."""
        return self._last_written is not None and self._last_written >= self.generation() - 2

    def advertise(self, admitted: Iterable[Admission]) -> None:
        now = self.clock.time()
        gen = generation(now)
        wanted: dict[str, None] = {}
        new = 0
        for adm in admitted:
            keys = adm.request.affinity
            if not keys or self._left_to_its_owner(adm.stream):
                continue
            if keys[-1] not in self._written and keys[-1] not in wanted:
                new += 1  # a prefix new to this worker
            for key in keys:
                if self._written.get(key) != gen:
                    wanted[key] = None
        if not wanted:
            return
        fields = {key: self.worker_id for key in wanted}
        pipe = self.client.pipeline(transaction=False)
        expiring = [g for g in (gen, gen + 1) if g not in self._expiring]
        for g in (gen, gen + 1):
            name = self.keys.affinity_owners(self.model, g)
            pipe.hset(name, mapping=fields)
            if g in expiring:
                # Read until generation g ends on a clock up to a generation behind this one.
                pipe.expire(name, int((g + 2) * OWNER_GENERATION_S - now) + 1)
        if new:
            pipe.hincrby(self.keys.affinity_owned(self.model), self.worker_id, new)
        pipe.execute()
        self._expiring = {g for g in (*self._expiring, *expiring) if g >= gen}
        self._last_written = gen
        self.owned += new
        for key in wanted:
            self._written[key] = gen
            self._written.move_to_end(key)
        while len(self._written) > REMEMBERED_KEYS:
            self._written.popitem(last=False)
        self.advertised += len(wanted)

    def _left_to_its_owner(self, stream: str) -> bool:
        """Whether a request read from ``stream`` was taken from a live worker's lane."""
        worker = self.keys.affinity_lane_worker(stream)
        if worker is None or worker == self.worker_id:
            return False
        self.view.refresh()
        return self.view.is_live(worker)
