"""Prefill/decode handoff: a prefill worker hands a request on once its prompt is computed
and its first token published; a decode worker continues it from the transferred KV.

The prefill side (publisher thread) stores the request's KV in the fleet tier under its
request id, then in one script, owner-checked, adds the request's message to the model's
handoff stream (``{ns}:handoff:{model}``) and acknowledges its lane entry: the two keys
share the model's hash tag, so this is one atomic step on Redis Cluster too. The decode
side (intake thread) reads the handoff stream like a lane, resumes after the tokens
already published, and fetches the KV; where the KV cannot be used (missing, expired,
corrupt, another model or dtype, no room) it recomputes the prompt instead: never worse
than recompute, and the cause is counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import redis
import structlog

from kvstore.tier import BlockLayout, TierError, TierRefused
from kvstore.tier.redis_tier import RedisKVTier
from producer.wire.keys import GROUP, LANES, Keys
from worker.kv_handoff import KVHandoff

log = structlog.get_logger(__name__)

# KEYS[1]: the lane, KEYS[2]: the handoff stream. ARGV: group, consumer, entry id, field,
# message. Adds the handoff and acknowledges the lane entry only while this consumer still
# owns it (its lease did not lapse to another worker); the new entry id, or false.
HAND_ON_SCRIPT = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if not (p[1] and p[1][2] == ARGV[2]) then
  return false
end
local id = redis.call('XADD', KEYS[2], '*', ARGV[4], ARGV[5])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
return id
"""


def streams_for(keys: Keys, model: str, role: str) -> list[str]:
    """The streams a worker of ``role`` reads, in the order it reads them: handed-on
    requests first (their KV waits in the tier), then the lanes."""
    lanes = [keys.requests(model, lane) for lane in LANES]
    if role == "prefill":
        return lanes
    if role == "decode":
        return [keys.handoff(model)]
    return [keys.handoff(model), *lanes]


@dataclass
class HandOn:
    """A request this prefill worker computed the prompt of, to hand on (publisher item)."""

    request_id: str
    stream: str  # the lane entry to acknowledge
    entry_id: str
    message: bytes  # the request as the producer sent it
    field: str
    kv: KVHandoff
    written: bool = False


class HandOnWriter:
    """The publisher's side: KV into the tier, then the atomic hand-on."""

    def __init__(self, client: redis.Redis, tier: RedisKVTier, layout: BlockLayout,
                 keys: Keys, model: str, worker_id: str) -> None:
        self.tier = tier
        self.layout = layout
        self.handoff_stream = keys.handoff(model)
        self.worker_id = worker_id
        self._script = client.register_script(HAND_ON_SCRIPT)
        self.handed_on = 0
        self.kv_refused = 0

    def write(self, item: HandOn) -> None:
        block = self.layout.block_size
        try:
            self.tier.put(item.request_id, self.layout, item.kv.payload,
                          -(-item.kv.num_tokens // block), item.kv.num_tokens)
        except TierRefused as exc:
            # The decode worker will find no KV and recompute: slower, never wrong.
            self.kv_refused += 1
            log.warning("kv tier refused a handoff's KV", request_id=item.request_id,
                        error=str(exc))
        moved = self._script(keys=[item.stream, self.handoff_stream],
                             args=[GROUP, self.worker_id, item.entry_id, item.field,
                                   item.message])
        item.written = True
        if moved:
            self.handed_on += 1
        else:
            log.warning("not handed on: the entry is no longer this worker's",
                        request_id=item.request_id, entry_id=item.entry_id)


class HandoffReader:
    """The intake's side: the KV of a handed-on request, or why it cannot be used."""

    def __init__(self, tier: RedisKVTier, layout: BlockLayout) -> None:
        self.tier = tier
        self.layout = layout
        self.imported = 0
        self.fallbacks: Counter[str] = Counter()

    def fetch(self, request_id: str, num_tokens: int) -> KVHandoff | None:
        """KV for the first tokens of a request that has ``num_tokens`` tokens now (prompt
        and published output); None (counted by cause) where it cannot be used."""
        try:
            header, payload = self.tier.get(request_id, self.layout)
        except TierError as exc:
            return self._fallback(request_id, exc.cause, str(exc))
        if not 0 < header.num_tokens < num_tokens:
            return self._fallback(request_id, "mismatch",
                                  f"KV of {header.num_tokens} tokens for {num_tokens}")
        # Read once: a decode worker that dies after this recomputes (its successor misses).
        self.tier.delete(request_id)
        self.imported += 1
        return KVHandoff(header.num_tokens, payload)

    def fallback(self, request_id: str, cause: str, why: str) -> None:
        """Count a KV that was fetched but could not be used after all (no room)."""
        self._fallback(request_id, cause, why)

    def _fallback(self, request_id: str, cause: str, why: str) -> None:
        self.fallbacks[cause] += 1
        log.warning("handed-on request recomputes its prompt", request_id=request_id,
                    cause=cause, reason=why)
        return None
