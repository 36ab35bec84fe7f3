"""Per-request block tables over the device pool, the prefix cache and the host swap tier."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvstore.block_pool import BlockPool
from kvstore.prefix_hash import BlockHash, extend_chain


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` token slots."""
    return -(-num_tokens // block_size)


@dataclass
class PrefixHit:
    """The longest cached prefix of a token sequence."""

    block_ids: list[int] = field(default_factory=list)
    # Hashes of every full block of the sequence (but its last token), hit or not.
    hashes: list[BlockHash] = field(default_factory=list)
    # The first block past the hit is being computed by a running request right now.
    pending: bool = False
    block_size: int = 16
    # Tokens covered when that is not a whole number of blocks: KV imported from the fleet
    # tier (hold_blocks), whose last block may be partly filled.
    tokens: int | None = None

    @property
    def num_tokens(self) -> int:
        if self.tokens is not None:
            return self.tokens
        return len(self.block_ids) * self.block_size


class KVCacheManager:
    """Maps each request to the ordered list of blocks that hold its KV.

    Position ``p`` of a request lives in slot ``p % block_size`` of block
    ``table[p // block_size]``. Full blocks are registered in the prefix cache once
    computed, so later requests with the same prefix share them. A swapped-out
    request holds host blocks instead of device blocks.
    """

    def __init__(self, pool: BlockPool, block_size: int, *, host_pool: BlockPool | None = None,
                 enable_prefix_caching: bool = False, watermark_blocks: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.host_pool = host_pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Admissions and swap-ins leave this many blocks free, so running requests can grow.
        self.watermark_blocks = watermark_blocks
        self._tables: dict[str, list[int]] = {}
        self._host_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        # Prefix blocks some running request is computing now: later requests wait for them.
        self._computing: dict[BlockHash, str] = {}

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    @property
    def block_tables(self) -> Mapping[str, list[int]]:
        """Every request's device block table, by request id: read it, never change it
        (the scheduler reads it for every running request every step)."""
        return self._tables

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables or request_id in self._host_tables

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks still to allocate so the request can hold ``num_tokens`` tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, blocks_for(num_tokens, self.block_size) - have)

    # ----- admission and growth -----

    def prefix_lookup(self, tokens: list[int],
                      chain_so_far: list[BlockHash] | None = None) -> PrefixHit:
        """Cached blocks covering the longest prefix of ``tokens``, leaving one token to compute.

        ``chain_so_far`` is the sequence's own hash chain, kept by its owner and extended
        here (each block is hashed once in the sequence's life); None hashes afresh.
        """
        hit = PrefixHit(block_size=self.block_size)
        if not self.enable_prefix_caching:
            return hit
        hit.hashes = extend_chain([] if chain_so_far is None else chain_so_far, tokens,
                                  self.block_size, (len(tokens) - 1) // self.block_size)
        for h in hit.hashes:
            b = self.pool.lookup(h)
            if b is None:
                hit.pending = h in self._computing
                break
            hit.block_ids.append(b)
        return hit

    def can_allocate(self, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Whether a new request could get blocks for its first ``num_tokens`` tokens."""
        reused = hit.block_ids if hit else []
        revived = sum(1 for b in reused if self.pool.ref_count(b) == 0)
        new = blocks_for(num_tokens, self.block_size) - len(reused)
        return new + revived + self.watermark_blocks <= self.pool.num_free

    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit | None = None) -> list[int]:
        """Give a new request the hit's cached blocks plus fresh ones up to ``num_tokens``."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        hit = hit or PrefixHit(block_size=self.block_size)
        for b in hit.block_ids:
            self.pool.share(b)
        fresh = self.pool.allocate(blocks_for(num_tokens, self.block_size) - len(hit.block_ids))
        self._tables[request_id] = hit.block_ids + fresh
        self._hashes[request_id] = hit.hashes[: len(hit.block_ids)]
        for h in hit.hashes[len(hit.block_ids) :]:
            self._computing.setdefault(h, request_id)
        return self._tables[request_id]

    def hold_blocks(self, num_tokens: int) -> PrefixHit:
        """Blocks for ``num_tokens`` tokens of KV that arrive from outside (the fleet tier),
        held until a request adopts them at admission (``allocate`` with this hit, then
        ``release_hold``) or ends (``release_hold``). OutOfBlocksError if they do not fit
        with the watermark left free."""
        n = blocks_for(num_tokens, self.block_size)
        if n + self.watermark_blocks > self.pool.num_free:
            from kvstore.block_pool import OutOfBlocksError

            raise OutOfBlocksError(f"{n} blocks for imported KV, {self.pool.num_free} free")
        return PrefixHit(block_ids=self.pool.allocate(n), block_size=self.block_size,
                         tokens=num_tokens)

    def release_hold(self, hit: PrefixHit) -> None:
        """Drop the hold taken by ``hold_blocks`` (a request that adopted them keeps its own
        reference)."""
        self.pool.free(hit.block_ids)

    def can_append_slots(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request's table can grow to hold ``num_tokens`` tokens in all."""
        return self.pool.can_allocate(self.num_new_blocks(request_id, num_tokens))

    def append_slots(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to hold ``num_tokens`` tokens in all; returns the new blocks."""
        new = self.pool.allocate(self.num_new_blocks(request_id, num_tokens))
        self._tables.setdefault(request_id, []).extend(new)
        return new

    def cache_computed(self, request_id: str, num_computed: int,
                       tokens: Callable[[], list[int]],
                       chain_so_far: list[BlockHash] | None = None) -> None:
        """Register the request's blocks that became full and computed (``tokens`` is lazy;
        ``chain_so_far``: the sequence's own hash chain, as in :meth:`prefix_lookup`)."""
        if not self.enable_prefix_caching:
            return
        known = self._hashes.setdefault(request_id, [])
        full = num_computed // self.block_size
        if full <= len(known):
            return
        table = self._tables[request_id]
        # Without the owner's chain, continue from the hashes registered so far.
        hashes = extend_chain(known[:] if chain_so_far is None else chain_so_far, tokens,
                              self.block_size, full)
        for i in range(len(known), full):
            h = hashes[i]
            self.pool.register(table[i], h)
            if self._computing.get(h) == request_id:
                del self._computing[h]
            known.append(h)

    def free(self, request_id: str) -> None:
        """Give back every block of the request, device or host (no-op if it holds none)."""
        table = self._tables.pop(request_id, None)
        if table:
            # Reverse order: a sequence's tail is the least likely to be shared, so evict it first.
            self.pool.free(list(reversed(table)))
        host = self._host_tables.pop(request_id, None)
        if host and self.host_pool is not None:
            self.host_pool.free(host)
        self._forget_hashes(request_id)

    # ----- host swap tier -----

    def can_swap_out(self, request_id: str) -> bool:
        n = len(self._tables.get(request_id, ()))
        return self.host_pool is not None and n > 0 and self.host_pool.can_allocate(n)

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request to host blocks; returns (device block, host block) copies to make."""
        assert self.host_pool is not None
        table = self._tables.pop(request_id)
        host = self.host_pool.allocate(len(table))
        self._host_tables[request_id] = host
        self.pool.free(list(reversed(table)))
        self._forget_hashes(request_id)
        return list(zip(table, host, strict=True))

    def can_swap_in(self, request_id: str, num_tokens: int) -> bool:
        """Whether the swapped request fits back on the device with room for ``num_tokens``."""
        n = max(len(self._host_tables[request_id]), blocks_for(num_tokens, self.block_size))
        return n + self.watermark_blocks <= self.pool.num_free

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request back to device blocks; returns (host block, device block) copies."""
        assert self.host_pool is not None
        host = self._host_tables.pop(request_id)
        device = self.pool.allocate(len(host))
        self._tables[request_id] = device
        self.host_pool.free(host)
        return list(zip(host, device, strict=True))

    def _forget_hashes(self, request_id: str) -> None:
        for h in self._hashes.pop(request_id, ()):
            if self._computing.get(h) == request_id:
                del self._computing[h]
        # Blocks it was still computing: nobody should wait for them any more.
        stale = [h for h, rid in self._computing.items() if rid == request_id]
        for h in stale:
            del self._computing[h]
