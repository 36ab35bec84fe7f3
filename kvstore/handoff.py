"""A request's KV as it crosses between engines: how many tokens it covers, and its bytes.

The prefill side takes it with ``export_kv`` (worker/fleet/handoff/engine_kv.py) once a
request's prompt is computed; the decode side hands it to ``add_with_kv`` there, which
writes it into fresh blocks and admits the request with those tokens already computed. In
between it travels through the fleet KV tier (kvstore.tier), which checks it against the
reader's model fingerprint and layout (``kv_layout`` there).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVHandoff:
    """KV of a request's first ``num_tokens`` tokens, as kvstore.kv_tensors.export_blocks
    lays out whole blocks (the last one may be partly filled): one payload for the whole
    run (a handoff), or one per block (``block_payloads``: full prefix blocks gathered from
    the fleet tier one by one, where ``payload`` is empty)."""

    num_tokens: int
    payload: bytes = b""
    block_payloads: tuple[bytes, ...] = ()
