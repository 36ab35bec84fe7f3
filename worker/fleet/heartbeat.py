"""The heartbeat thread: a worker's status and load in a hash that expires if it dies."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import redis

from producer.wire.keys import Keys
from producer.wire.protocol import now_ms
from worker.fleet.supervised import SupervisedThread


class Heartbeat(SupervisedThread):
    """Every interval, writes ``{ns}:worker:{id}`` with a TTL of three intervals."""

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, interval_s: float,
                 status: Callable[[], dict[str, object]], **supervision: Any) -> None:
        super().__init__("heartbeat", worker_id=worker_id, interval_s=interval_s, **supervision)
        self.client = client
        self.key = keys.worker(worker_id)
        self.status = status
        self.static = {"worker_id": worker_id, "pid": os.getpid(), "host": socket.gethostname(),
                       "started_ms": now_ms()}

    def tick(self) -> None:
        self.beat()

    def beat(self) -> None:
        mapping = {**self.static, **self.status(), "updated_ms": now_ms()}
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.key, mapping={k: str(v) for k, v in mapping.items()})
        pipe.expire(self.key, max(1, int(3 * self.interval_s + 0.999)))
        pipe.execute()

    def clear(self) -> None:
        """Remove the worker's hash at exit."""
        try:
            self.client.delete(self.key)
        except redis.RedisError:
            pass
