"""The fleet KV tier: KV blocks kept outside any one worker, so another worker can continue
a request (prefill/decode handoff) or reuse a prompt prefix without computing it.

What is stored is always a header that says exactly what the bytes are (model fingerprint,
dtype, layout, block size, shape, checksum) and the raw bytes of whole blocks, never
pickle. ``header.py`` and ``interface.py`` do no I/O; ``redis_tier.py`` keeps both in
Redis; the tensors' bytes come from ``kvstore.kv_tensors`` (docs/kv-tier.md).
"""

from kvstore.tier.header import (
    BlockLayout,
    KVHeader,
    TierCorrupt,
    TierError,
    TierMismatch,
    TierMiss,
    TierRefused,
    TierUnavailable,
)
from kvstore.tier.interface import KVTier

__all__ = ["BlockLayout", "KVHeader", "KVTier", "TierCorrupt", "TierError", "TierMismatch",
           "TierMiss", "TierRefused", "TierUnavailable"]
