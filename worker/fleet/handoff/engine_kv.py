"""An engine's KV as the fleet moves it: exported by a prefill worker or for prefix sharing,
imported by the worker that continues a request. Functions over an Engine, so the offline
engine keeps one narrow hook (``Engine.add_request(preloaded=...)``, after ``settle``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

from kvstore import OutOfBlocksError, PrefixHit, blocks_for
from kvstore.handoff import KVHandoff
from kvstore.kv_tensors import block_layout, export_blocks, import_blocks
from kvstore.prefix_hash import extend_chain
from kvstore.tier.header import BlockLayout, TierMismatch
from producer.wire.params import SamplingParams
from worker.engine.engine import Engine
from worker.models.fingerprint import model_fingerprint

# Each engine's model fingerprint, computed on first use (it hashes every weight byte).
_fingerprints: weakref.WeakKeyDictionary[Engine, str] = weakref.WeakKeyDictionary()
_fingerprints_lock = threading.Lock()


class KVNotAdopted(ValueError):
    """Imported KV the engine cannot take (it covers the wrong span, or its blocks do not
    fit now); the request itself may still be added without it, its prompt computed."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        # "mismatch" or "no_room", as the handoff's fallbacks count them.
        self.cause = cause


def engine_fingerprint(engine: Engine) -> str:
    """The engine's model by content (worker.models.fingerprint), computed once."""
    with _fingerprints_lock:
        known = _fingerprints.get(engine)
    if known is None:
        known = model_fingerprint(engine.model_dir, str(engine.dtype).removeprefix("torch."))
        with _fingerprints_lock:
            _fingerprints[engine] = known
    return known


def kv_layout(engine: Engine, fingerprint: str | None = None) -> BlockLayout:
    """What the engine's KV blocks are, for the fleet tier's checks (``fingerprint``: the
    engine's own unless given). A simulated engine has none: TierMismatch, so whatever
    KV a handoff offers it (one a real prefill worker left) is recomputed instead."""
    if engine.kv_cache is None:
        raise TierMismatch("a simulated engine has no KV to import or export")
    return block_layout(engine.kv_cache, fingerprint or engine_fingerprint(engine))


def export_kv(engine: Engine, request_id: str) -> KVHandoff:
    """The KV of every token of ``request_id`` computed so far (after the step that sampled
    its first token: the whole prompt), for another engine to continue from."""
    engine.settle()  # a running step may still write its blocks
    req = engine.scheduler.requests.get(request_id)
    if req is None or not req.status.running:
        raise ValueError(f"request {request_id!r} is not running here")
    n = req.num_computed_tokens
    blocks = engine.kv.block_table(request_id)[:blocks_for(n, engine.config.block_size)]
    return KVHandoff(n, export_blocks(engine.kv_cache, blocks))


def export_prefix_blocks(engine: Engine, request_id: str) -> list[tuple[bytes, bytes]]:
    """(chain hash, bytes) of every full block of the request's prompt computed so far, for
    the fleet tier's prefix sharing (the hash names the whole prefix to that block). A step
    still running never writes these blocks: no need to wait for it."""
    req = engine.scheduler.requests.get(request_id)
    if req is None or not req.status.running:
        raise ValueError(f"request {request_id!r} is not running here")
    bs = engine.config.block_size
    full = min(req.num_computed_tokens, req.num_prompt_tokens) // bs
    if full == 0:
        return []
    hashes = extend_chain(req.block_hashes, req.all_token_ids, bs, full)
    table = engine.kv.block_table(request_id)
    return [(h, export_blocks(engine.kv_cache, [table[i]])) for i, h in enumerate(hashes)]


def add_with_kv(engine: Engine, prompt_ids: Sequence[int],
                params: SamplingParams | None, kv: KVHandoff, *,
                generated_token_ids: Sequence[int] = (), **request: Any) -> str:
    """``engine.add_request`` for a request whose first ``kv.num_tokens`` tokens' KV comes
    from another engine (checked by the caller against :func:`kv_layout`): those tokens are
    not computed again. KVNotAdopted when the KV cannot be taken now (it must leave at
    least one token to compute, and its blocks must fit); any other ValueError is the
    request's own, as ``add_request`` raises it. Either way the engine is left untouched.
    """
    total = len(prompt_ids) + len(generated_token_ids)
    if not 0 < kv.num_tokens < total:
        raise KVNotAdopted("mismatch", f"imported KV covers {kv.num_tokens} tokens: it must "
                           f"cover at least one and leave one of the request's {total} to "
                           "compute")
    engine.settle()  # the runner thread must not be writing blocks we are about to fill
    hit = _hold_imported_kv(engine, kv)
    try:
        return engine.add_request(prompt_ids, params, generated_token_ids=generated_token_ids,
                                  preloaded=hit, **request)
    except Exception:
        engine.kv.release_hold(hit)
        raise


def _hold_imported_kv(engine: Engine, kv: KVHandoff) -> PrefixHit:
    """Fresh blocks holding ``kv``, held for the request that is about to be added."""
    try:
        hit = engine.kv.hold_blocks(kv.num_tokens)
    except OutOfBlocksError as exc:
        raise KVNotAdopted("no_room", f"no room for the imported KV now: {exc}") from exc
    try:
        if kv.block_payloads:
            for block_id, payload in zip(hit.block_ids, kv.block_payloads, strict=True):
                import_blocks(engine.kv_cache, [block_id], payload)
        else:
            import_blocks(engine.kv_cache, hit.block_ids, kv.payload)
    except Exception as exc:
        engine.kv.release_hold(hit)
        if isinstance(exc, ValueError):  # bytes of another size than the blocks
            raise KVNotAdopted("mismatch", str(exc)) from exc
        raise
    return hit
