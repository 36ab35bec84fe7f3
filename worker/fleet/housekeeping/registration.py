"""A worker announces its model so producers can tokenize without the model's files."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import redis
import structlog

from producer.chat_template import CHAT_FIELDS, ChatTemplate
from producer.client.client import read_heartbeats
from producer.client.models import is_live
from producer.clock import Clock
from producer.wire.keys import Keys
from producer.wire.protocol import now_ms
from worker.engine.engine import Engine

log = structlog.get_logger(__name__)


class MixedFleet(ValueError):
    """A simulated worker and a real one would serve one model name."""


def check_same_kind(client: redis.Redis, keys: Keys, name: str, simulated: bool,
                    worker_id: str) -> None:
    """Refuse to serve ``name`` beside live or starting workers of the other kind: a
    simulated worker's tokens are not the model's (worker/engine/simulated.py), and nobody
    reading a stream could tell which kind wrote it.

    The caller publishes its own heartbeat (status ``starting``) first: of two workers of
    both kinds that start at once, each checks after its own heartbeat is out, so at least
    one of them sees the other and refuses (both may). A worker user made before this check
    read heartbeats may lack HGETALL: the check is then skipped, with a warning."""
    try:
        heartbeats = read_heartbeats(client, keys)
    except redis.exceptions.NoPermissionError as exc:
        log.warning("cannot read the other workers' heartbeats: whether a worker of the other "
                    "kind serves this model is not checked (grant +hgetall: docs/security.md)",
                    model=name, error=str(exc))
        return
    other = next((hb for hb in heartbeats
                  if (is_live(hb) or hb.get("status") == "starting") and hb.get("model") == name
                  and hb.get("worker_id") != worker_id
                  and (hb.get("simulated") or "") != ("1" if simulated else "")), None)
    if other is not None:
        mine, theirs = ("simulated", "real") if simulated else ("real", "simulated")
        raise MixedFleet(f"model {name!r} is served by {theirs} worker "
                         f"{other.get('worker_id')!r}: a {mine} worker cannot serve it beside "
                         f"it; use another --served-model-name")


def register_model(client: redis.Redis, keys: Keys, name: str, engine: Engine,
                   model_dir: Path, worker_id: str,
                   chat_template: ChatTemplate | None = None) -> None:
    """Write the model hash: name, max length, eos ids, vocab size, tokenizer.json, the chat
    template, and whether its workers are simulated."""
    tokenizer_file = Path(model_dir) / "tokenizer.json"
    mapping = {
        "name": name,
        "max_model_len": engine.max_model_len,
        "eos_token_ids": json.dumps(sorted(engine.eos_token_ids)),
        "vocab_size": engine.model_config.vocab_size,
        "served_by": worker_id,
        "updated_ms": now_ms(),
        # "1": served by simulated workers, whose tokens are not the model's.
        "simulated": "1" if engine.simulated else "",
    }
    if tokenizer_file.is_file():
        mapping["tokenizer_json"] = tokenizer_file.read_text(encoding="utf-8")
    if chat_template is not None:
        # Producers that count prompt tokens render messages exactly as workers do.
        mapping.update(chat_template.to_registration())
    pipe = client.pipeline(transaction=False)  # two keys: no MULTI (Redis Cluster)
    if chat_template is None:  # a template an earlier registration left must not linger
        pipe.hdel(keys.model(name), *CHAT_FIELDS)
    pipe.hset(keys.model(name), mapping=mapping)
    # The set lists models without SCAN; a reader that finds a name sees its hash.
    pipe.sadd(keys.models, name)
    pipe.execute()


def load_chat_template(model_dir: Path, clock: Clock) -> ChatTemplate | None:
    """The model folder's chat template (its date from ``clock``); None when it has none,
    or when it does not compile (logged: the worker still serves prompts, and refuses
    messages with that reason)."""
    try:
        return ChatTemplate.from_model_dir(
            model_dir, now=lambda: datetime.fromtimestamp(clock.time()))
    except ValueError as exc:
        log.error("the model's chat template cannot be used: requests with messages will be "
                  "refused", model_dir=str(model_dir), error=str(exc))
        return None


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

