"""Prefill/decode handoff: a prefill worker hands a request on once its prompt is computed
and its first token published; a decode worker continues it from the transferred KV.

The prefill side (the tier writer thread, tier_io.py) stores the request's KV in the fleet
tier under its request id, then in one script, owner-checked, adds the request's message
to the model's handoff stream of its lane (``{ns}:handoff:{model}:{lane}``), saying
whether the tier took the KV, and acknowledges its lane entry: the two keys share the
model's hash tag, so this is one atomic step on Redis Cluster too. The decode side's
intake reads the handoff streams like lanes, interactive first, resumes after the tokens
already published, and its tier reader thread fetches the KV; where the KV cannot be used
(missing, expired, corrupt, another model or dtype, no room) it recomputes the prompt
instead: never worse than recompute, and the cause is counted.
"""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import redis
import structlog

from kvstore.handoff import KVHandoff
from kvstore.tier import BlockLayout, TierError, TierUnavailable
from kvstore.tier.redis_tier import RedisKVTier
from producer.wire.keys import GROUP, LANES, Keys
from worker.fleet.messages import HandOn

log = structlog.get_logger(__name__)

# The handoff entry's field that says whether the tier took the KV ("1") or not ("0"): a
# decode worker does not look the tier up for KV that was never stored (a frozen tier
# would cost it a timeout for nothing). Entries without it (older workers): look it up.
KV_STORED_FIELD = "kv"

# KEYS[1]: the lane, KEYS[2]: the handoff stream. ARGV: group, consumer, entry id, field,
# message, KV_STORED_FIELD, "1" or "0". Adds the handoff and acknowledges the lane entry
# only while this consumer still owns it (its lease did not lapse to another worker); the
# new entry id, or false.
HAND_ON_SCRIPT = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if not (p[1] and p[1][2] == ARGV[2]) then
  return false
end
local id = redis.call('XADD', KEYS[2], '*', ARGV[4], ARGV[5], ARGV[6], ARGV[7])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
return id
"""


@dataclass
class Transfers:
    """KV moved through the tier by one side: bytes, seconds spent, runs (for metrics;
    seconds are measured, never decided on)."""

    bytes: int = 0
    seconds: float = 0.0
    count: int = 0

    def add(self, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.seconds += seconds
        self.count += 1


class UsesLayout:
    """For the tier's readers and writers: this engine's KV layout, asked for only when a
    transfer happens (its model fingerprint hashes every weight byte)."""

    _layout: Callable[[], BlockLayout]

    @property
    def layout(self) -> BlockLayout:
        return self._layout()


def tokens_hash(tokens: list[int]) -> str:
    """What a handoff's KV was computed from, so a reader never adopts another request's
    KV stored under the same (reused) id."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).hexdigest()


def streams_for(keys: Keys, model: str, role: str, affinity_of: str | None = None
                ) -> list[str]:
    """The streams a worker of ``role`` reads, in the order it reads them: handed-on
    requests first (their KV waits in the tier), then the lanes, each after the affinity
    lane of that lane of worker ``affinity_of`` (None: no affinity lanes)."""
    lanes = [stream for lane in LANES for stream in (
        ([keys.affinity_lane(model, affinity_of, lane)] if affinity_of else [])
        + [keys.requests(model, lane)])]
    handoffs = [keys.handoff(model, lane) for lane in LANES]  # interactive first here too
    if role == "prefill":
        return lanes
    if role == "decode":
        return handoffs
    return [*handoffs, *lanes]


class HandOnWriter(UsesLayout):
    """The publisher's side: KV into the tier, then the atomic hand-on."""

    def __init__(self, client: redis.Redis, tier: RedisKVTier, layout: Callable[[], BlockLayout],
                 keys: Keys, model: str, worker_id: str) -> None:
        self.tier = tier
        # What this engine's KV is (computed on first use: it hashes every weight).
        self._layout = layout
        self.keys = keys
        self.model = model
        self.worker_id = worker_id
        self._script = client.register_script(HAND_ON_SCRIPT)
        self.handed_on = 0
        self.kv_refused = 0
        self.transfers = Transfers()

    def write(self, item: HandOn, with_kv: bool = True) -> None:
        """Put the KV in the tier (unless ``with_kv`` is False: the decode worker then
        recomputes), then hand the request on. Tier errors never stop the hand-on; a
        lost connection to the queues' Redis raises (the caller retries)."""
        stored = with_kv and item.kv is not None and self._put(item)
        handoff = self.keys.handoff(self.model, self.keys.lane_of(item.stream))
        moved = self._script(keys=[item.stream, handoff],
                             args=[GROUP, self.worker_id, item.entry_id, item.field,
                                   item.message, KV_STORED_FIELD, "1" if stored else "0"])
        item.written = True
        if moved:
            self.handed_on += 1
        else:
            log.warning("not handed on: the entry is no longer this worker's",
                        request_id=item.request_id, entry_id=item.entry_id)

    def _put(self, item: HandOn) -> bool:
        """Whether the tier took the request's KV."""
        block = self.layout.block_size
        try:
            started = time.perf_counter()
            self.tier.put(item.request_id, self.layout, item.kv.payload,
                          -(-item.kv.num_tokens // block), item.kv.num_tokens,
                          tokens_hash=item.tokens_hash)
            self.transfers.add(len(item.kv.payload), time.perf_counter() - started)
            return True
        except (TierError, redis.RedisError) as exc:
            # Refused, or the tier's Redis unreachable or skipped: the decode worker will
            # find no KV and recompute (slower, never wrong); the hand-on must not wait.
            self.kv_refused += 1
            log.warning("kv tier did not take a handoff's KV", request_id=item.request_id,
                        error=str(exc))
            if not isinstance(exc, TierUnavailable):
                self._forget_stale(item.request_id)
            return False

    def _forget_stale(self, request_id: str) -> None:
        """A refused put must not leave an older run under the same id (a reused request
        id) for the decode worker to find; the token hash would catch it too."""
        try:
            self.tier.delete(request_id)
        except (TierError, redis.RedisError):
            pass


class HandoffReader(UsesLayout):
    """The intake's side: the KV of a handed-on request, or why it cannot be used."""

    def __init__(self, tier: RedisKVTier, layout: Callable[[], BlockLayout]) -> None:
        self.tier = tier
        # What this engine's KV is (computed on first use: it hashes every weight).
        self._layout = layout
        self.imported = 0
        self.transfers = Transfers()
        self.fallbacks: Counter[str] = Counter()
        # Counted from the intake and the engine loop threads.
        self._lock = threading.Lock()

    def fetch(self, request_id: str, tokens: list[int]) -> KVHandoff | None:
        """KV for the first of ``tokens`` (the request's prompt and published output);
        None (counted by cause) where it cannot be used. Never raises for the tier: a tier
        that cannot be read is a fallback like any other."""
        try:
            started = time.perf_counter()
            header, payload = self.tier.get(request_id, self.layout)
            self.transfers.add(len(payload), time.perf_counter() - started)
            if not 0 < header.num_tokens < len(tokens):
                return self._fallback(request_id, "mismatch",
                                      f"KV of {header.num_tokens} tokens for {len(tokens)}")
            if header.tokens_hash != tokens_hash(tokens[:header.num_tokens]):
                return self._fallback(request_id, "mismatch", "KV of other tokens (a reused "
                                      "request id)")
            self._forget_read(request_id)
        except TierError as exc:
            return self._fallback(request_id, exc.cause, str(exc))
        except redis.RedisError as exc:
            return self._fallback(request_id, "unreachable", str(exc))
        return KVHandoff(header.num_tokens, payload)

    def _forget_read(self, request_id: str) -> None:
        """Read once: a decode worker that dies after this recomputes (its successor
        misses). A delete that fails leaves the run to its TTL (and the token hash guards a
        reused id): the KV just read is used all the same."""
        try:
            self.tier.delete(request_id)
        except (TierError, redis.RedisError) as exc:
            log.info("kv tier did not delete a handoff read", request_id=request_id,
                     error=str(exc))

    def adopted(self) -> None:
        """The engine took a fetched KV (counted only then, never beside a fallback)."""
        with self._lock:
            self.imported += 1

    def fallback(self, request_id: str, cause: str, why: str) -> None:
        """Count a KV that was fetched but could not be used after all (no room)."""
        self._fallback(request_id, cause, why)

    def _fallback(self, request_id: str, cause: str, why: str) -> None:
        with self._lock:
            self.fallbacks[cause] += 1
        log.warning("handed-on request recomputes its prompt", request_id=request_id,
                    cause=cause, reason=why)
        return None
