"""The KV tier in Redis: headers and chunked block bytes under ``{ns}:kv:``, with TTLs.

A run of blocks named N is one header key and its chunk keys, all hash-tagged on N so a
Redis Cluster keeps them in one slot (one pipeline, one MGET):

    {ns}:kv:{N}:h     the header (kvstore.tier.header.KVHeader, msgpack)
    {ns}:kv:{N}:c<i>  chunk i of the bytes, at most ``chunk_bytes`` each

Writes go chunks first, header last, so a reader that finds a header finds the chunks
it names, unless they expired or were deleted since, which the reader's size and checksum
checks catch (TierCorrupt, and the caller recomputes). The tier never takes more than
``max_bytes`` nor lets Redis's used memory pass ``maxmemory_fraction`` of its
``maxmemory``: where it shares a Redis with the request queues, a full tier must refuse
its own writes long before Redis refuses the queues'. Run it on its own Redis in
production (``--kv-redis``).

Bytes are counted in time buckets of a quarter TTL (``{ns}:kv:bytes:<bucket>``): a run
counts in the bucket it was written in until that bucket leaves the window of the last
five, by when the run has expired; a delete takes its bytes back from that same bucket.
So expired runs stop counting on their own, and nothing drifts.

A tier that stops answering must not stall the worker that uses it: each round trip moves
at most one chunk, under the client's own (short) socket timeout, and a round trip that
gets no answer opens the worker's breaker (kvstore/tier/breaker.py), which then turns the
tier's calls away at once for a while. Either way the caller sees TierUnavailable and
goes on without the tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

from kvstore.tier.breaker import Breaker
from kvstore.tier.header import (
    BlockLayout,
    KVHeader,
    TierCorrupt,
    TierMiss,
    TierRefused,
    TierUnavailable,
    checksum,
)
from producer.wire.keys import Keys

DEFAULT_CHUNK_BYTES = 512 * 1024
DEFAULT_TTL_S = 600
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
# Buckets of a quarter TTL each that the byte count sums: a run written in the oldest one
# has expired by the time that bucket leaves the window.
WINDOW_BUCKETS = 5


class RedisKVTier:
    """KVTier on one Redis (or one Cluster slot per run of blocks)."""

    def __init__(self, client: redis.Redis, namespace: str = "conveyor", *,
                 ttl_s: int = DEFAULT_TTL_S, max_bytes: int = DEFAULT_MAX_BYTES,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 maxmemory_fraction: float = 0.5,
                 now: Callable[[], float] = time.time,
                 breaker: Breaker | None = None) -> None:
        if ttl_s < 1 or max_bytes < 1 or chunk_bytes < 1 or not 0 < maxmemory_fraction <= 1:
            raise ValueError("ttl_s, max_bytes and chunk_bytes must be >= 1 and "
                             "maxmemory_fraction in (0, 1]")
        self.client = client
        self.keys = Keys(namespace)
        self.ttl_ms = ttl_s * 1000
        self.max_bytes = max_bytes
        self.chunk_bytes = chunk_bytes
        self.maxmemory_fraction = maxmemory_fraction
        self.now = now  # unix seconds; tests move it
        self.bucket_s = ttl_s / 4
        # Shared by the worker's tier clients; None: every call tries the tier.
        self.breaker = breaker

    @contextmanager
    def _guarded(self, what: str) -> Iterator[None]:
        """Run one call of the interface past the breaker: turned away at once while it is
        open; a round trip without an answer opens it; any answer closes it."""
        generation = self.breaker.allow() if self.breaker is not None else 0
        if generation is None:
            raise TierUnavailable(f"the KV tier is skipped for now (it did not answer a "
                                  f"round trip within its timeout): no {what}")
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if self.breaker is not None:
                self.breaker.failed()
            raise TierUnavailable(f"the KV tier did not answer a {what}: {exc}") from exc
        except BaseException:
            if self.breaker is not None:
                self.breaker.succeeded(generation)  # an answer, even a refusal or a miss
            raise
        if self.breaker is not None:
            self.breaker.succeeded(generation)

    # ----- keys -----

    def header_key(self, name: str) -> str:
        return self.keys.kv_header(name)

    def chunk_key(self, name: str, index: int) -> str:
        return self.keys.kv_chunk(name, index)

    # ----- the interface -----

    def put(self, name: str, layout: BlockLayout, payload: bytes, num_blocks: int,
            num_tokens: int, tokens_hash: str = "") -> KVHeader:
        if len(payload) != num_blocks * layout.bytes_per_block:
            raise ValueError(f"{len(payload)} bytes are not {num_blocks} blocks of "
                             f"{layout.bytes_per_block}")
        with self._guarded("write"):
            return self._put(name, layout, payload, num_blocks, num_tokens, tokens_hash)

    def _put(self, name: str, layout: BlockLayout, payload: bytes, num_blocks: int,
             num_tokens: int, tokens_hash: str) -> KVHeader:
        try:
            self._check_room(len(payload))
        except redis.ResponseError as exc:  # its GET or INFO refused (e.g. LOADING)
            raise TierRefused(f"redis refused the KV tier's room check: {exc}") from exc
        view = memoryview(payload)
        chunks = [view[i:i + self.chunk_bytes] for i in range(0, len(view), self.chunk_bytes)]
        self._uncount(name)  # an overwrite takes the old run's bytes back first
        stored_at = self.now()
        header = KVHeader(layout, num_blocks, num_tokens, tuple(len(c) for c in chunks),
                          checksum(view), tokens_hash, stored_at)
        try:
            for i, chunk in enumerate(chunks):  # a round trip a chunk: each within the timeout
                try:
                    self.client.set(self.chunk_key(name, i), chunk.tobytes(), px=self.ttl_ms)
                except redis.ResponseError:
                    if i:  # some chunks landed: give their room back now, not at their TTL
                        self.client.delete(*[self.chunk_key(name, j) for j in range(i)])
                    raise TierRefused(f"redis refused a KV write for {name!r}") from None
            # The header last: a reader that sees it finds every chunk written.
            pipe = self.client.pipeline(transaction=False)
            pipe.set(self.header_key(name), header.encode(), px=self.ttl_ms)
            bucket = self.bytes_key(self._bucket(stored_at))
            pipe.incrby(bucket, len(payload))
            pipe.pexpire(bucket, self._bucket_ttl_ms())
            pipe.execute()
        except redis.ResponseError as exc:  # OOM, READONLY, LOADING: not this tier's to retry
            raise TierRefused(f"redis refused a KV write: {exc}") from exc
        return header

    def get(self, name: str, layout: BlockLayout) -> tuple[KVHeader, bytes]:
        with self._guarded("read"):
            return self._get(name, layout)

    def _get(self, name: str, layout: BlockLayout) -> tuple[KVHeader, bytes]:
        raw = self.client.get(self.header_key(name))
        if raw is None:
            raise TierMiss(f"no KV stored under {name!r}")
        header = KVHeader.decode(raw)
        header.check_layout(layout)
        if not header.chunk_sizes:
            raise TierCorrupt(f"the header under {name!r} names no chunks")
        chunks = []
        for i, size in enumerate(header.chunk_sizes):  # a round trip a chunk, as written
            chunk = self.client.get(self.chunk_key(name, i))
            if chunk is None or len(chunk) != size:
                raise TierCorrupt(f"chunk {i} of {name!r} is missing or truncated")
            chunks.append(chunk)
        payload = b"".join(chunks)
        if checksum(payload) != header.checksum:
            raise TierCorrupt(f"the bytes under {name!r} do not match their checksum")
        return header, payload

    def delete(self, name: str) -> None:
        with self._guarded("delete"):
            self._uncount(name, delete=True)

    def _uncount(self, name: str, delete: bool = False) -> None:
        """Take a stored run's bytes back from its bucket (and delete its keys)."""
        raw = self.client.get(self.header_key(name))
        if raw is None:
            return
        try:
            header = KVHeader.decode(raw)
        except TierCorrupt:
            if delete:
                self.client.delete(self.header_key(name))
            return
        pipe = self.client.pipeline(transaction=False)
        if delete:
            pipe.delete(self.header_key(name),
                        *[self.chunk_key(name, i) for i in range(len(header.chunk_sizes))])
        bucket = self._bucket(header.stored_at)
        if bucket > self._bucket(self.now()) - WINDOW_BUCKETS:  # still counted
            pipe.decrby(self.bytes_key(bucket), header.payload_bytes)
        pipe.execute()

    def has(self, name: str) -> bool:
        with self._guarded("lookup"):
            return bool(self.client.exists(self.header_key(name)))

    # ----- room -----

    def bytes_key(self, bucket: int) -> str:
        return self.keys.kv_bytes(bucket)

    def _bucket(self, t: float) -> int:
        return int(t // self.bucket_s)

    def _bucket_ttl_ms(self) -> int:
        return int((WINDOW_BUCKETS + 1) * self.bucket_s * 1000)

    def bytes_in_use(self) -> int:
        """What the tier counts as stored: runs written in the last five buckets (a run
        expires within four) and not deleted. A run counts for at most a bucket past its
        expiry, so the bound errs on refusing, never on taking too much."""
        current = self._bucket(self.now())
        counts = self.client.mget([self.bytes_key(b)
                                   for b in range(current - WINDOW_BUCKETS + 1, current + 1)])
        return max(0, sum(int(c) for c in counts if c is not None))

    def _check_room(self, nbytes: int) -> None:
        if self.bytes_in_use() + nbytes > self.max_bytes:
            raise TierRefused(f"the KV tier holds {self.bytes_in_use()} of its "
                              f"{self.max_bytes} bytes: no room for {nbytes}")
        memory = self.client.info("memory")
        maxmemory = int(memory.get("maxmemory", 0) or 0)
        if maxmemory and int(memory.get("used_memory", 0)) + nbytes \
                > self.maxmemory_fraction * maxmemory:
            raise TierRefused(f"redis would pass {self.maxmemory_fraction:.0%} of its "
                              f"maxmemory ({maxmemory} bytes) with {nbytes} more")
