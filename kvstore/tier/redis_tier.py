"""The KV tier in Redis: headers and chunked block bytes under ``{ns}:kv:``, with TTLs.

A run of blocks named N is one header key and its chunk keys, all hash-tagged on N so a
Redis Cluster keeps them in one slot (one pipeline, one MGET):

    {ns}:kv:{N}:h     the header (kvstore.tier.header.KVHeader, msgpack)
    {ns}:kv:{N}:c<i>  chunk i of the bytes, at most ``chunk_bytes`` each

Writes go chunks first, header last, so a reader that finds a header finds the chunks
it names, unless they expired or were deleted since, which the reader's size and checksum
checks catch (TierCorrupt, and the caller recomputes). The tier never takes more than
``max_bytes`` (counted in ``{ns}:kv:bytes``) nor lets Redis's used memory pass
``maxmemory_fraction`` of its ``maxmemory``: where it shares a Redis with the request
queues, a full tier must refuse its own writes long before Redis refuses the queues'.
Run it on its own Redis in production (``--kv-redis``).
"""

from __future__ import annotations

import redis

from kvstore.tier.header import (
    BlockLayout,
    KVHeader,
    TierCorrupt,
    TierMiss,
    TierRefused,
    checksum,
)

DEFAULT_CHUNK_BYTES = 512 * 1024
DEFAULT_TTL_S = 600
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class RedisKVTier:
    """KVTier on one Redis (or one Cluster slot per run of blocks)."""

    def __init__(self, client: redis.Redis, namespace: str = "conveyor", *,
                 ttl_s: int = DEFAULT_TTL_S, max_bytes: int = DEFAULT_MAX_BYTES,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 maxmemory_fraction: float = 0.5) -> None:
        if ttl_s < 1 or max_bytes < 1 or chunk_bytes < 1 or not 0 < maxmemory_fraction <= 1:
            raise ValueError("ttl_s, max_bytes and chunk_bytes must be >= 1 and "
                             "maxmemory_fraction in (0, 1]")
        self.client = client
        self.ns = namespace
        self.ttl_ms = ttl_s * 1000
        self.max_bytes = max_bytes
        self.chunk_bytes = chunk_bytes
        self.maxmemory_fraction = maxmemory_fraction
        self.bytes_key = f"{namespace}:kv:bytes"

    # ----- keys -----

    def header_key(self, name: str) -> str:
        return f"{self.ns}:kv:{{{name}}}:h"

    def chunk_key(self, name: str, index: int) -> str:
        return f"{self.ns}:kv:{{{name}}}:c{index}"

    # ----- the interface -----

    def put(self, name: str, layout: BlockLayout, payload: bytes, num_blocks: int,
            num_tokens: int) -> KVHeader:
        if len(payload) != num_blocks * layout.bytes_per_block:
            raise ValueError(f"{len(payload)} bytes are not {num_blocks} blocks of "
                             f"{layout.bytes_per_block}")
        self._check_room(len(payload))
        view = memoryview(payload)
        chunks = [view[i:i + self.chunk_bytes] for i in range(0, len(view), self.chunk_bytes)]
        header = KVHeader(layout, num_blocks, num_tokens, tuple(len(c) for c in chunks),
                          checksum(view))
        try:
            pipe = self.client.pipeline(transaction=False)
            for i, chunk in enumerate(chunks):
                pipe.set(self.chunk_key(name, i), chunk.tobytes(), px=self.ttl_ms)
            if any(isinstance(r, Exception) for r in pipe.execute(raise_on_error=False)):
                # Some chunks may have landed: give their room back now, not at their TTL.
                self.client.delete(*[self.chunk_key(name, i) for i in range(len(chunks))])
                raise TierRefused(f"redis refused a KV write for {name!r}")
            # The header last: a reader that sees it finds every chunk written.
            pipe = self.client.pipeline(transaction=False)
            pipe.set(self.header_key(name), header.encode(), px=self.ttl_ms)
            pipe.incrby(self.bytes_key, len(payload))
            pipe.pexpire(self.bytes_key, self.ttl_ms)
            pipe.execute()
        except redis.ResponseError as exc:  # OOM, READONLY, LOADING: not this tier's to retry
            raise TierRefused(f"redis refused a KV write: {exc}") from exc
        return header

    def get(self, name: str, layout: BlockLayout) -> tuple[KVHeader, bytes]:
        raw = self.client.get(self.header_key(name))
        if raw is None:
            raise TierMiss(f"no KV stored under {name!r}")
        header = KVHeader.decode(raw)
        header.check_layout(layout)
        chunks = self.client.mget([self.chunk_key(name, i)
                                   for i in range(len(header.chunk_sizes))])
        for i, (chunk, size) in enumerate(zip(chunks, header.chunk_sizes, strict=True)):
            if chunk is None or len(chunk) != size:
                raise TierCorrupt(f"chunk {i} of {name!r} is missing or truncated")
        payload = b"".join(chunks)
        if checksum(payload) != header.checksum:
            raise TierCorrupt(f"the bytes under {name!r} do not match their checksum")
        return header, payload

    def delete(self, name: str) -> None:
        raw = self.client.get(self.header_key(name))
        if raw is None:
            return
        try:
            header = KVHeader.decode(raw)
        except TierCorrupt:
            self.client.delete(self.header_key(name))
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self.header_key(name),
                    *[self.chunk_key(name, i) for i in range(len(header.chunk_sizes))])
        pipe.decrby(self.bytes_key, header.payload_bytes)
        pipe.execute()

    def has(self, name: str) -> bool:
        return bool(self.client.exists(self.header_key(name)))

    # ----- room -----

    def bytes_in_use(self) -> int:
        """What the tier counts as stored: written and not deleted, until the counter's own
        TTL (renewed by every write) lapses. Entries that expired are still counted, so the
        bound errs on refusing."""
        return max(0, int(self.client.get(self.bytes_key) or 0))

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
