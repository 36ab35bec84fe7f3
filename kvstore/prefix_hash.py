"""Content hashes of full KV blocks, chained so a hash names the whole prefix up to its block."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable

BlockHash = bytes

# The chain starts from a fixed root so the first block's hash also names "a sequence start".
ROOT = b"conveyor-prefix-v1"


def block_hash(parent: BlockHash | None, tokens: list[int]) -> BlockHash:
    """Hash of one full block given its parent's hash: equal hashes mean equal prefixes.

    A cryptographic digest, not Python's hash(): a collision would hand one request
    another's KV, and prompts can be chosen by anyone who can submit.
    """
    h = hashlib.blake2b(parent or ROOT, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain(tokens: list[int], block_size: int, start: int = 0,
          parent: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of the full blocks of ``tokens`` from block index ``start`` on."""
    out = []
    for b in range(start, len(tokens) // block_size):
        parent = block_hash(parent, tokens[b * block_size : (b + 1) * block_size])
        out.append(parent)
    return out


def extend_chain(hashes: list[BlockHash], tokens: list[int] | Callable[[], list[int]],
                 block_size: int, num_blocks: int) -> list[BlockHash]:
    """Grow ``hashes`` (a sequence's chain so far, kept by its owner) in place to its first
    ``num_blocks`` full blocks, hashing only the blocks not hashed yet; returns those
    ``num_blocks`` hashes. ``tokens`` may be a callable, called only when hashing is due.

    A sequence only ever grows, so a block, once hashed, keeps its hash: a request waiting
    for room, or swapped out and back, never hashes its prompt again.
    """
    if len(hashes) < num_blocks:
        seq = tokens() if callable(tokens) else tokens
        hashes.extend(chain(seq[: num_blocks * block_size], block_size, start=len(hashes),
                            parent=hashes[-1] if hashes else None))
    return hashes[:num_blocks]
