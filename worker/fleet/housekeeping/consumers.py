"""Removing what dead workers leave behind: consumers in a group, once they hold nothing,
and their ids in the ``{ns}:workers`` set.

Every worker name ever used stays in the group until removed, and `conveyor top`, XINFO
and the lane metrics count them. A consumer is removed only when it has been idle (no
read, no claim) for long and has no pending entry: XGROUP DELCONSUMER drops a consumer's
pending entries with it, so the script checks the pending list again in the same atomic
step (one key: it runs unchanged on Redis Cluster).
"""

from __future__ import annotations

import redis

from producer.client.models import member_names
from producer.wire.keys import GROUP, Keys, as_text

# ARGV: group, consumer names. Removes each that has no pending entry; returns those.
REMOVE_IF_EMPTY_SCRIPT = """
local removed = {}
for i = 2, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[i]) == 0 then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[i])
    removed[#removed + 1] = ARGV[i]
  end
end
return removed
"""


class ConsumerSweeper:
    """Removes consumers idle longer than ``idle_ms`` that hold no pending entries."""

    def __init__(self, client: redis.Redis, worker_id: str, idle_ms: int) -> None:
        self.client = client
        self.worker_id = worker_id
        self.idle_ms = idle_ms
        self._script = client.register_script(REMOVE_IF_EMPTY_SCRIPT)
        self.removed = 0

    def sweep(self, stream: str) -> list[str]:
        """The names removed from ``stream``'s group (none when it has no group yet)."""
        try:
            consumers = self.client.xinfo_consumers(stream, GROUP)
        except redis.ResponseError:  # no stream or no group yet: nothing to sweep
            return []
        idle = [name for c in consumers
                if (name := as_text(c["name"])) != self.worker_id
                and int(c["pending"]) == 0 and int(c["idle"]) >= self.idle_ms]
        if not idle:
            return []
        removed = [as_text(n) for n in self._script(keys=[stream], args=[GROUP, *idle])]
        self.removed += len(removed)
        return removed



def prune_worker_set(client: redis.Redis, keys: Keys) -> list[str]:
    """Remove from ``{ns}:workers`` the ids whose heartbeat hash expired (dead workers); a
    live worker that was removed during an outage adds itself again at its next beat."""
    members = member_names(client.smembers(keys.workers))
    if not members:
        return []
    pipe = client.pipeline(transaction=False)
    for wid in members:
        pipe.exists(keys.worker(wid))
    gone = [wid for wid, alive in zip(members, pipe.execute(), strict=True) if not alive]
    if not gone:
        return []
    client.srem(keys.workers, *gone)
    # A worker that came back between the EXISTS and the SREM (its beat writes the hash,
    # then adds itself) would stay unlisted until its next beat: put it back now.
    pipe = client.pipeline(transaction=False)
    for wid in gone:
        pipe.exists(keys.worker(wid))
    back = [wid for wid, alive in zip(gone, pipe.execute(), strict=True) if alive]
    if back:
        client.sadd(keys.workers, *back)
    return [wid for wid in gone if wid not in back]
