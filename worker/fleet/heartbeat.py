"""The heartbeat thread: a worker's status and load in a hash that expires if it dies."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable

import redis
import structlog

from producer.logging import bind_thread_context
from producer.wire.keys import Keys
from producer.wire.protocol import now_ms

log = structlog.get_logger(__name__)


class Heartbeat(threading.Thread):
    """Every interval, writes ``{ns}:worker:{id}`` with a TTL of three intervals."""

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, interval_s: float,
                 status: Callable[[], dict[str, object]]) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.client = client
        self.key = keys.worker(worker_id)
        self.interval_s = interval_s
        self.status = status
        self.worker_id = worker_id
        self.stopping = threading.Event()
        self.static = {"worker_id": worker_id, "pid": os.getpid(), "host": socket.gethostname(),
                       "started_ms": now_ms()}

    def beat(self) -> None:
        mapping = {**self.static, **self.status(), "updated_ms": now_ms()}
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.key, mapping={k: str(v) for k, v in mapping.items()})
        pipe.expire(self.key, max(1, int(3 * self.interval_s + 0.999)))
        pipe.execute()

    def run(self) -> None:
        bind_thread_context(worker_id=self.worker_id)
        while not self.stopping.wait(self.interval_s):
            try:
                self.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed", error=str(exc))

    def clear(self) -> None:
        """Remove the worker's hash at a clean exit."""
        try:
            self.client.delete(self.key)
        except redis.RedisError:
            pass
