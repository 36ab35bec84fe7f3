"""Per-request block tables on top of the block pool: who holds which blocks."""

from __future__ import annotations

from kvstore.block_pool import BlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` token slots."""
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Maps each request to the ordered list of blocks that hold its KV.

    Position ``p`` of a request lives in slot ``p % block_size`` of block
    ``table[p // block_size]``. Capacity only grows while a request runs and is
    returned whole by ``free``.
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self._tables: dict[str, list[int]] = {}

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks still to allocate so the request can hold ``num_tokens`` tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, blocks_for(num_tokens, self.block_size) - have)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new request could get blocks for its first ``num_tokens`` tokens."""
        return self.pool.can_allocate(blocks_for(num_tokens, self.block_size))

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Give a new request blocks for its first ``num_tokens`` tokens."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        self._tables[request_id] = self.pool.allocate(blocks_for(num_tokens, self.block_size))
        return self._tables[request_id]

    def can_append_slots(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request's table can grow to hold ``num_tokens`` tokens in all."""
        return self.pool.can_allocate(self.num_new_blocks(request_id, num_tokens))

    def append_slots(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to hold ``num_tokens`` tokens in all; returns the new blocks."""
        new = self.pool.allocate(self.num_new_blocks(request_id, num_tokens))
        self._tables.setdefault(request_id, []).extend(new)
        return new

    def free(self, request_id: str) -> None:
        """Give back every block of the request (a no-op for one that holds none)."""
        table = self._tables.pop(request_id, None)
        if table:
            # Reverse order: the tail of a sequence is the least likely to be shared later.
            self.pool.free(list(reversed(table)))

    def slot(self, request_id: str, position: int) -> int:
        table = self._tables[request_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size
