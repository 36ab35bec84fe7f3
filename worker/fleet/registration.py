"""A worker announces its model so producers can tokenize without the model's files."""

from __future__ import annotations

import json
from pathlib import Path

import redis

from producer.wire.keys import Keys
from producer.wire.protocol import now_ms
from worker.engine import Engine


def register_model(client: redis.Redis, keys: Keys, name: str, engine: Engine,
                   model_dir: Path, worker_id: str) -> None:
    """Write the model hash: name, max length, eos ids, vocab size and tokenizer.json."""
    tokenizer_file = Path(model_dir) / "tokenizer.json"
    mapping = {
        "name": name,
        "max_model_len": engine.max_model_len,
        "eos_token_ids": json.dumps(sorted(engine.eos_token_ids)),
        "vocab_size": engine.model_config.vocab_size,
        "served_by": worker_id,
        "updated_ms": now_ms(),
    }
    if tokenizer_file.is_file():
        mapping["tokenizer_json"] = tokenizer_file.read_text(encoding="utf-8")
    pipe = client.pipeline(transaction=False)  # two keys: no MULTI (Redis Cluster)
    pipe.hset(keys.model(name), mapping=mapping)
    # The set lists models without SCAN; a reader that finds a name sees its hash.
    pipe.sadd(keys.models, name)
    pipe.execute()


def check_eviction_policy(client: redis.Redis, allowed: bool) -> str:
    """Refuse (ValueError) to serve from a Redis that may evict keys, unless ``allowed``.

    Streams hold the requests and their consumer group: under any policy but noeviction a
    full Redis may drop a whole request stream, and every request in it with no trace.
    Returns the policy found.
    """
    try:
        policy = str(client.info("memory").get("maxmemory_policy", "noeviction"))
    except redis.ResponseError as exc:
        if allowed:
            return "unknown"
        raise ValueError(f"cannot read Redis's maxmemory-policy ({exc}): grant the worker "
                         "INFO, or pass --allow-eviction if its keys may be evicted") from exc
    if policy != "noeviction" and not allowed:
        raise ValueError(
            f"Redis's maxmemory-policy is {policy!r}: it may evict a request stream with its "
            "consumer group and every request in it. Set `maxmemory-policy noeviction` (a full "
            "Redis then refuses writes, which workers retry), or pass --allow-eviction to "
            "accept the loss")
    return policy

