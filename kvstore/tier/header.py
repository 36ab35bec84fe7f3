"""What a stored run of KV blocks is, and the checks a reader makes before trusting it."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import msgpack

HEADER_VERSION = 1


class TierError(Exception):
    """A transfer that cannot be used; the caller recomputes instead ("never worse")."""

    cause = "error"


class TierMiss(TierError):
    """Nothing stored under that name (never written, expired, or deleted)."""

    cause = "missing"


class TierCorrupt(TierError):
    """Stored, but not what the header promised: a chunk missing or short, or the bytes'
    checksum differs."""

    cause = "corrupt"


class TierMismatch(TierError):
    """Intact, but for another model, dtype, layout or block size than the reader's."""

    cause = "mismatch"


class TierRefused(TierError):
    """The tier would not take the write (its size bound, or Redis refused it)."""

    cause = "refused"


class TierUnavailable(TierRefused):
    """The tier did not answer in time, or is skipped for a while after it did not
    (kvstore/tier/breaker.py): nothing is stored or read, as if it had refused."""

    cause = "unreachable"


@dataclass(frozen=True)
class BlockLayout:
    """Everything a reader must share with the writer for the bytes to mean the same KV.

    ``fingerprint`` names the model by its content (config, weights, dtype), not by its
    served name: two deployments under one name with other weights never share KV.
    """

    fingerprint: str
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    itemsize: int
    # Order of one layer's block: token-major ``[block_size, num_kv_heads, head_dim]``,
    # K of every layer, then V of every layer (kvstore.kv_tensors.export_blocks).
    layout: str = "NHD/k-layers-then-v-layers"

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim \
            * self.itemsize


@dataclass(frozen=True)
class KVHeader:
    """One stored run of blocks: its layout, size, how it is chunked and its checksum."""

    layout: BlockLayout
    num_blocks: int
    # Tokens whose KV the blocks hold (the last block may be partly filled).
    num_tokens: int
    # Byte length of each stored chunk, in order; they add up to the payload.
    chunk_sizes: tuple[int, ...]
    checksum: str  # blake2b-128 of the whole payload, hex
    # What the KV was computed from (the writer's hash of the token ids; "" when unsaid).
    tokens_hash: str = ""
    # When it was stored (unix seconds): which of the tier's byte-count buckets holds it.
    stored_at: float = 0.0

    @property
    def payload_bytes(self) -> int:
        return sum(self.chunk_sizes)

    def encode(self) -> bytes:
        body = asdict(self)
        body["chunk_sizes"] = list(self.chunk_sizes)
        return msgpack.packb({"v": HEADER_VERSION, **body}, use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> KVHeader:
        try:
            body = msgpack.unpackb(raw, raw=False)
            if body.pop("v") != HEADER_VERSION:
                raise ValueError("another header version")
            layout = BlockLayout(**body.pop("layout"))
            return cls(layout=layout, num_blocks=int(body["num_blocks"]),
                       num_tokens=int(body["num_tokens"]),
                       chunk_sizes=tuple(int(n) for n in body["chunk_sizes"]),
                       checksum=str(body["checksum"]),
                       tokens_hash=str(body.get("tokens_hash", "")),
                       stored_at=float(body.get("stored_at", 0.0)))
        except Exception as exc:  # any malformed header is one cause: corrupt
            raise TierCorrupt(f"unreadable header: {exc}") from exc

    def check_layout(self, expected: BlockLayout) -> None:
        """TierMismatch naming the first field that differs from the reader's layout."""
        for field, want in asdict(expected).items():
            got = getattr(self.layout, field)
            if got != want:
                raise TierMismatch(f"stored {field} {got!r}, this worker's {want!r}")
        if self.payload_bytes != self.num_blocks * expected.bytes_per_block:
            raise TierCorrupt(f"{self.payload_bytes} bytes for {self.num_blocks} blocks of "
                              f"{expected.bytes_per_block}")


def checksum(payload: bytes | memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()
