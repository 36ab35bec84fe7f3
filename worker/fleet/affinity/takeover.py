"""Taking requests from other workers' affinity lanes: those that waited past the affinity
delay for a busy worker, and every one of a worker that is gone or draining."""

from __future__ import annotations

import redis

from producer.clock import SYSTEM_CLOCK, Clock
from producer.wire.keys import GROUP, LANES, Keys, as_text
from worker.fleet.affinity.fleet_view import FleetView

# One round trip, atomic: per lane (in the order given), the entries not yet delivered whose
# id is at least that lane's minimum age old by the server's clock (stream ids are its
# milliseconds; age 0: all of them), read to this consumer; at most ARGV[3] in all.
# Returns {lane, entries} pairs, entries as XREADGROUP gives them.
TAKE_SCRIPT = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local left = tonumber(ARGV[3])
local out = {}
for i, lane in ipairs(KEYS) do
  if left <= 0 then break end
  if redis.call('EXISTS', lane) == 1 then
    local delivered = nil
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', lane)) do
      local info = {}
      for j = 1, #g, 2 do info[g[j]] = g[j + 1] end
      if info['name'] == ARGV[1] then delivered = info['last-delivered-id'] end
    end
    if delivered == nil then
      -- a lane nobody made the group of (its stream was lost and added to again)
      redis.call('XGROUP', 'CREATE', lane, ARGV[1], '0')
      delivered = '0-0'
    end
    -- (a lane read up to an id in the far future is blocked: reopen_lane's to mend)
    if tonumber(string.match(delivered, '^(%d+)')) < 1000000000000000 then
      local age = tonumber(ARGV[3 + i])
      local n = 0
      for _, e in ipairs(redis.call('XRANGE', lane, '(' .. delivered, '+', 'COUNT', left)) do
        if age > 0 and tonumber(string.match(e[1], '^(%d+)')) > now_ms - age then break end
        n = n + 1
      end
      if n > 0 then
        local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', n,
                               'STREAMS', lane, '>')
        out[#out + 1] = {lane, got[1][2]}
        left = left - #got[1][2]
      end
    end
  end
end
return out
"""


# The shortest time between two looks (a delay of 0 would otherwise make an idle worker
# look without pause).
LOOK_MIN_S = 0.02
LOOK_MAX_S = 1.0


class Takeover:
    """An idle worker's look at the other workers' affinity lanes (interactive lanes first).

    A full worker's requests (its heartbeat says it has no room) are taken once they waited
    ``delay_ms``; a worker that is gone (its heartbeat expired) or draining has its requests
    taken at once; a live worker with room reads its own. Each look is one script call over
    those lanes, at most one a look interval, and only when this worker has room and
    nothing waits for it in its own lanes.
    """

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str,
                 view: FleetView, delay_ms: int, clock: Clock = SYSTEM_CLOCK) -> None:
        self.client, self.keys, self.model, self.worker_id = client, keys, model, worker_id
        self.view, self.delay_ms, self.clock = view, delay_ms, clock
        self.taken = 0  # requests taken from other workers' lanes
        self._script = client.register_script(TAKE_SCRIPT)
        self._next_look = 0.0  # (clock.monotonic()) looks are at most one a look interval

    @property
    def look_interval_s(self) -> float:
        """Seconds between two looks: the delay (a request waits for a busy worker between
        the delay and twice it), at most LOOK_MAX_S (what a gone worker left waits at most
        that), at least LOOK_MIN_S."""
        return max(LOOK_MIN_S, min(LOOK_MAX_S, self.delay_ms / 1000))

    def lanes(self, live_too: bool = True) -> list[tuple[str, int]]:
        """(lane, minimum age in ms) of the other workers' affinity lanes to look at, in
        look order; ``live_too`` False: only those of workers that are not live."""
        # Gone workers first (nobody else serves them), then the live ones that are full.
        others = sorted(self._to_look_at(live_too), key=lambda w: self.view.is_live(w))
        return [(self.keys.affinity_lane(self.model, w, lane),
                 self.delay_ms if self.view.is_live(w) else 0)
                for lane in LANES for w in others]

    def worth_looking(self, live_too: bool = True) -> bool:
        """Whether any lane may hold a request this worker should take (``live_too`` False:
        of a worker that is not live)."""
        return bool(self._to_look_at(live_too))

    def _to_look_at(self, live_too: bool) -> list[str]:
        """The other workers whose lanes may hold what this one should take: none with room
        (a live worker with room reads its own lane at once), and with ``live_too`` False
        none that is live."""
        self.view.refresh()
        return [w for w in self.view.others() if not self.view.has_room(w)
                and (live_too or not self.view.is_live(w))]

    def due(self) -> bool:
        """Whether a look is due (one a look interval at most: an idle worker's looks are
        its only steady cost)."""
        return self.clock.monotonic() >= self._next_look

    def take(self, room: int, live_too: bool = True) -> list[tuple[str, str, dict]]:
        """Up to ``room`` entries from other workers' lanes, as (lane, entry id, fields)."""
        self._next_look = self.clock.monotonic() + self.look_interval_s
        lanes = self.lanes(live_too)
        if not lanes or room <= 0:
            return []
        reply = self._script(keys=[lane for lane, _ in lanes],
                             args=[GROUP, self.worker_id, room, *(age for _, age in lanes)])
        out = []
        for lane, entries in reply or []:
            for entry_id, flat in entries:
                fields = dict(zip(flat[::2], flat[1::2], strict=True)) if flat else {}
                out.append((as_text(lane), as_text(entry_id), fields))
        self.taken += len(out)
        return out
