"""Forgetting a gone worker's affinity lanes, once nothing is in them and no producer can
still send it a request."""

from __future__ import annotations

import redis

from producer.affinity.routing import OWNER_GENERATION_S
from producer.clock import SYSTEM_CLOCK, Clock
from producer.wire.keys import Keys
from worker.fleet.affinity.fleet_view import FleetView

# Seconds a worker's heartbeat must have been gone, as one reaper saw it, before its lanes
# go: longer than its advertisements are read (two generations) and any producer trusts a
# heartbeat (5 s), so nothing is added to a lane after it is removed.
PRUNE_AFTER_S = 2 * OWNER_GENERATION_S + 60
# KEYS: the worker's lanes, then the lanes set and the owned hash (one hash slot: the
# model's); ARGV[1]: the worker id. Removes them only when both lanes hold no entry (a
# trimmed lane holds none once nothing in it waits or is pending).
PRUNE_SCRIPT = """
local n = #KEYS - 2
for i = 1, n do
  if redis.call('XLEN', KEYS[i]) > 0 then return 0 end
end
for i = 1, n do redis.call('DEL', KEYS[i]) end
redis.call('SREM', KEYS[n + 1], ARGV[1])
redis.call('HDEL', KEYS[n + 2], ARGV[1])
return 1
"""


class LanePruner:
    """Each housekeeping round: removes the lanes, listing and count of workers whose
    heartbeat has been gone PRUNE_AFTER_S, when their lanes are empty (the round trims
    them first)."""

    def __init__(self, client: redis.Redis, keys: Keys, model: str, view: FleetView,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.client, self.keys, self.model, self.view, self.clock = (client, keys, model,
                                                                    view, clock)
        self.pruned = 0
        self._gone_since: dict[str, float] = {}
        self._script = client.register_script(PRUNE_SCRIPT)

    def prune(self) -> int:
        now = self.clock.monotonic()
        others = [w for w in self.view.others() if not self.view.is_live(w)]
        pipe = self.client.pipeline(transaction=False)
        for worker in others:
            pipe.exists(self.keys.worker(worker))
        present = pipe.execute() if others else []
        self._gone_since = {w: self._gone_since.get(w, now)
                            for w, there in zip(others, present, strict=True) if not there}
        done = 0
        for worker, since in list(self._gone_since.items()):
            if now - since < PRUNE_AFTER_S:
                continue
            lanes = self.keys.affinity_lanes_of(self.model, worker)
            if self._script(keys=[*lanes, self.keys.affinity_lanes(self.model),
                                  self.keys.affinity_owned(self.model)], args=[worker]):
                done += 1
                del self._gone_since[worker]
        self.pruned += done
        return done
