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
    client.hset(keys.model(name), mapping=mapping)
