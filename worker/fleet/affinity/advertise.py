"""Advertising the prefixes a worker holds: each affinity key of the requests it serves
names it, unless another live worker holds that prefix already."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import redis

from producer.clock import SYSTEM_CLOCK, Clock
from producer.wire.keys import Keys, as_text
from producer.wire.protocol import GenerationRequest
from worker.fleet.affinity.fleet_view import FleetView

# Seconds an advertisement lives unless renewed: about as long as a prefix nobody asks for
# stays in a busy worker's cache. Renewed when a request with the key is served here and
# half of that has passed.
ADVERTISEMENT_TTL_S = 300
# Keys this worker remembers having advertised (each renewed at most every TTL / 2).
REMEMBERED_KEYS = 65_536


class Advertiser:
    """Names this worker as the owner of its requests' prefixes (``{ns}:affinity:{model}:
    k:{key}``): a key nobody owns, or whose owner no longer takes requests, becomes this
    worker's; one this worker owns is renewed; one a live worker owns is left to it (this
    worker took the request over while that one was busy).

    Costs one MGET and one pipeline of SETs for the keys of a read, and nothing for keys
    it advertised less than TTL / 2 ago (a document's later questions).
    """

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str,
                 view: FleetView, clock: Clock = SYSTEM_CLOCK) -> None:
        self.client, self.keys, self.model, self.worker_id = client, keys, model, worker_id
        self.view, self.clock = view, clock
        self.advertised = 0  # keys set (new, renewed or taken over)
        # Prefixes this worker became the owner of (the deepest key of a request), counted
        # in ``{ns}:affinity:{{model}}:owned`` too: new prefixes go to the workers with fewest.
        self.owned = 0
        self._fresh: OrderedDict[str, float] = OrderedDict()  # key -> when set

    def join(self) -> None:
        """Start this worker's count of owned prefixes at the fewest a live worker has (a
        worker that joins late takes its share of new prefixes, not all of them until it
        caught up)."""
        self.view.refresh(force=True)
        self.owned = self.view.fewest_owned()
        self.client.hset(self.keys.affinity_owned(self.model), self.worker_id, self.owned)

    def advertise(self, requests: Iterable[GenerationRequest]) -> None:
        requests = list(requests)
        now = self.clock.monotonic()
        wanted = list(dict.fromkeys(
            key for req in requests for key in (req.affinity or ())
            if now - self._fresh.get(key, -ADVERTISEMENT_TTL_S) >= ADVERTISEMENT_TTL_S / 2))
        if not wanted:
            return
        deepest = {req.affinity[-1] for req in requests if req.affinity}
        names = [self.keys.affinity_owner(self.model, key) for key in wanted]
        owners = self.client.mget(names)
        self.view.refresh()
        pipe = self.client.pipeline(transaction=False)
        taken, new = [], 0
        for key, name, owner in zip(wanted, names, owners, strict=True):
            holder = None if owner is None else as_text(owner)
            if holder not in (None, self.worker_id) and self.view.is_live(holder):
                continue
            pipe.set(name, self.worker_id, ex=ADVERTISEMENT_TTL_S)
            taken.append(key)
            if key in deepest and holder != self.worker_id:  # a prefix new to this worker
                new += 1
        if new:
            pipe.hincrby(self.keys.affinity_owned(self.model), self.worker_id, new)
        if taken:
            pipe.execute()
        self.owned += new
        for key in taken:
            self._fresh[key] = now
            self._fresh.move_to_end(key)
        while len(self._fresh) > REMEMBERED_KEYS:
            self._fresh.popitem(last=False)
        self.advertised += len(taken)
