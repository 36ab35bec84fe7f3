"""The tier's interface: names to runs of KV blocks, for handoffs and for shared prefixes.

Metadata and bytes are separate on purpose. Redis keeps both today; a GPU transport
(NIXL, Mooncake) would move the bytes device to device while the header, which says what
they are and where, stays in Redis: ``put``/``get`` are the two sides of that split.
"""

from __future__ import annotations

from typing import Protocol

from kvstore.tier.header import BlockLayout, KVHeader


class KVTier(Protocol):
    """Runs of whole KV blocks under a name: a request id (a handoff) or a prefix chain hash.

    ``put`` raises TierRefused where the tier will not take the bytes; ``get`` raises
    TierMiss, TierCorrupt or TierMismatch where they cannot be used. Neither ever hands
    back bytes that were not checked against the reader's layout and the checksum.
    """

    def put(self, name: str, layout: BlockLayout, payload: bytes, num_blocks: int,
            num_tokens: int) -> KVHeader: ...

    def get(self, name: str, layout: BlockLayout) -> tuple[KVHeader, bytes]: ...

    def delete(self, name: str) -> None: ...

    def has(self, name: str) -> bool: ...
