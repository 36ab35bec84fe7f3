"""The heartbeat thread: a worker's status and load in a hash that expires if it dies.

Each beat also adds the worker to the ``{ns}:workers`` set (readers list workers without
SCAN), and checks what a Redis restarted without persistence forgets: conveyor's Redis
functions (producers need them to submit with ``max_queue``: producer/redis/functions.py)
and the model's registration (producers that tokenize, and bulk analysis, wait for it).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import redis
import structlog

from producer.redis.functions import MISSING, MODIFIED, UNSUPPORTED, ensure_functions
from producer.wire.keys import Keys
from producer.wire.protocol import now_ms
from worker.fleet.supervised import SupervisedThread

log = structlog.get_logger(__name__)


def heartbeat_ttl_s(interval_s: float) -> int:
    """Whole seconds a heartbeat hash lives unless renewed: three intervals."""
    return max(1, int(3 * interval_s + 0.999))


class Heartbeat(SupervisedThread):
    """Every interval, writes ``{ns}:worker:{id}`` with a TTL of three intervals."""

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, interval_s: float,
                 status: Callable[[], dict[str, object]], **supervision: Any) -> None:
        super().__init__("heartbeat", worker_id=worker_id, interval_s=interval_s, **supervision)
        self.client = client
        self.key = keys.worker(worker_id)
        self.keys = keys
        self.worker_id = worker_id
        # What keep_functions last found ("" before its first check).
        self.functions = ""
        self.status = status
        # The model's hash, and what writes it again (given this client) when a beat finds
        # it gone: set by keep_registration once the worker has registered, never before
        # (a worker refused at start must leave no registration behind).
        self.model_key: str | None = None
        self.register: Callable[[redis.Redis], None] | None = None
        self.static = {"worker_id": worker_id, "pid": os.getpid(), "host": socket.gethostname(),
                       "started_ms": now_ms()}

    def tick(self) -> None:
        self.beat()
        self.keep_functions()

    def keep_functions(self) -> str:
        """Check conveyor's functions (loading them when missing, if this user may); the
        state found, also kept in ``functions`` for the heartbeat. Logged when it changes."""
        if self.functions == UNSUPPORTED:
            return UNSUPPORTED
        try:
            state = ensure_functions(self.client)
        except redis.exceptions.NoPermissionError:
            state = "unknown"  # this user may not even list functions
        if state != self.functions:
            if state in (MISSING, MODIFIED):
                log.warning("conveyor's Redis functions are " + state + ": producers that "
                            "submit with max_queue fail until an administrator runs "
                            "`conveyor redis setup`", functions=state)
            else:
                log.info("conveyor's Redis functions checked", functions=state)
        self.functions = state
        return state

    def beat(self) -> None:
        mapping = {**self.static, **self.status(), "updated_ms": now_ms()}
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.key, mapping={k: str(v) for k, v in mapping.items()})
        pipe.expire(self.key, heartbeat_ttl_s(self.interval_s))
        pipe.sadd(self.keys.workers, self.worker_id)
        if self.register is not None:
            pipe.exists(self.model_key)
        replies = pipe.execute()
        if self.register is not None and not replies[-1]:
            log.warning("the model's registration was gone (a Redis restarted without "
                        "persistence?): writing it again", key=self.model_key)
            try:
                self.register(self.client)
            except (OSError, redis.RedisError) as exc:  # (the next beat tries again)
                log.warning("the model's registration could not be written again",
                            error=str(exc))

    def keep_registration(self, model_key: str, register: Callable[[redis.Redis], None]
                          ) -> None:
        """From now on, write the model's registration again where a beat finds it gone."""
        self.model_key, self.register = model_key, register

    def clear(self) -> None:
        """Remove the worker's hash, and its id from the workers set, at exit."""
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(self.key)
            pipe.srem(self.keys.workers, self.worker_id)
            pipe.execute()
        except redis.RedisError:
            pass
