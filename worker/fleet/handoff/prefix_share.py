"""Fleet-wide prefix reuse through the KV tier (``--kv-share-prefixes``).

A worker that computed a prompt puts its full blocks in the tier, one entry per block
named by the block's chain hash (which names the whole prefix up to it, see
kvstore/prefix_hash.py) and the model's fingerprint. A worker whose own prefix cache
misses a new request's first block looks the request's blocks up in the tier, in order,
and continues from the longest run it finds instead of computing it. Writes happen on
the tier writer thread and lookups on the tier reader thread (tier_io.py): neither the
engine loop nor the threads that publish tokens and read requests wait on the tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import redis
import structlog

from kvstore.handoff import KVHandoff
from kvstore.prefix_hash import chain
from kvstore.tier import BlockLayout, TierError, TierMiss
from kvstore.tier.redis_tier import RedisKVTier
from producer.clock import SYSTEM_CLOCK, Clock
from worker.fleet.handoff.handoff import UsesLayout
from worker.fleet.messages import SharePrefix

log = structlog.get_logger(__name__)

# Hashes of blocks this worker already put, so a popular prefix is written once (bounded).
MAX_REMEMBERED = 100_000


def prefix_name(layout: Callable[[], BlockLayout], block_hash: bytes) -> str:
    return f"prefix:{layout.fingerprint[:16]}:{block_hash.hex()}"


class PrefixSharer(UsesLayout):
    """The publisher's side: puts blocks the tier may not have yet."""

    def __init__(self, tier: RedisKVTier, layout: Callable[[], BlockLayout],
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.tier = tier
        # What this engine's KV is (computed on first use: it hashes every weight).
        self._layout = layout
        self.clock = clock
        # Block hash -> when this worker put it; put again once half its TTL has passed,
        # so a prefix every worker uses does not vanish from the tier at its TTL.
        self._put: OrderedDict[bytes, float] = OrderedDict()
        self.blocks_put = 0
        self.refused = 0

    def write(self, item: SharePrefix) -> None:
        now = self.clock.monotonic()
        fresh_for = self.tier.ttl_ms / 2000
        for block_hash, payload in item.blocks:
            put_at = self._put.get(block_hash)
            if put_at is not None and now - put_at < fresh_for:
                continue
            try:
                self.tier.put(prefix_name(self.layout, block_hash), self.layout, payload, 1,
                              self.layout.block_size)
            except (TierError, redis.RedisError) as exc:
                self.refused += 1
                log.info("kv tier did not take a prefix block", error=str(exc))
                break  # later blocks are useless without this one
            self.blocks_put += 1
            self._put[block_hash] = now
            self._put.move_to_end(block_hash)
            if len(self._put) > MAX_REMEMBERED:
                self._put.popitem(last=False)
        item.written = True


class PrefixFinder(UsesLayout):
    """The intake's side: the longest run of a prompt's blocks the tier holds."""

    def __init__(self, tier: RedisKVTier, layout: Callable[[], BlockLayout],
                 cached_here: Callable[[bytes], bool]) -> None:
        self.tier = tier
        # What this engine's KV is (computed on first use: it hashes every weight).
        self._layout = layout
        self.cached_here = cached_here
        self.hits = 0
        self.hit_tokens = 0
        self.fallbacks = 0

    def find(self, prompt_ids: list[int]) -> KVHandoff | None:
        bs = self.layout.block_size
        wanted = (len(prompt_ids) - 1) // bs  # at least one token is left to compute
        if wanted == 0:
            return None
        hashes = chain(prompt_ids[:wanted * bs], bs)
        if self.cached_here(hashes[0]):
            return None  # this worker's own prefix cache serves it, without a transfer
        payloads: list[bytes] = []
        for block_hash in hashes:
            try:
                _, payload = self.tier.get(prefix_name(self.layout, block_hash), self.layout)
            except TierMiss:
                break
            except (TierError, redis.RedisError) as exc:  # corrupt, other model's, or the
                self.fallbacks += 1                       # tier unreachable: compute from here
                log.warning("unusable prefix block in the kv tier", error=str(exc))
                break
            payloads.append(payload)
        if not payloads:
            return None
        self.hits += 1
        self.hit_tokens += len(payloads) * bs
        return KVHandoff(len(payloads) * bs, block_payloads=tuple(payloads))
