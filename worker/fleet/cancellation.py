"""Cancellations: a pub/sub listener, and the marker keys for requests not yet seen."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import redis
import structlog

from producer.logging import bind_thread_context
from producer.wire.keys import Keys

log = structlog.get_logger(__name__)


class CancelListener(threading.Thread):
    """Subscribes to the cancel channel and forwards each id to ``on_cancel``."""

    def __init__(self, client: redis.Redis, keys: Keys, on_cancel: Callable[[str], None],
                 worker_id: str = "") -> None:
        super().__init__(name="cancel-listener", daemon=True)
        self.worker_id = worker_id
        self.client = client
        self.keys = keys
        self.on_cancel = on_cancel
        self.stopping = threading.Event()
        self.subscribed = threading.Event()

    def run(self) -> None:
        bind_thread_context(worker_id=self.worker_id)
        while not self.stopping.is_set():
            try:
                self._listen()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("cancel listener lost redis, resubscribing", error=str(exc))
                self.subscribed.clear()
                time.sleep(0.5)

    def _listen(self) -> None:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(self.keys.cancel_channel)
            self.subscribed.set()
            while not self.stopping.is_set():
                msg = pubsub.get_message(timeout=0.5)
                if msg and msg.get("type") == "message":
                    data = msg["data"]
                    self.on_cancel(data.decode() if isinstance(data, bytes) else str(data))
        finally:
            pubsub.close()


def cancelled_ids(client: redis.Redis, keys: Keys, request_ids: list[str]) -> set[str]:
    """Which of these requests carry a cancellation marker (cancelled before we read them)."""
    if not request_ids:
        return set()
    pipe = client.pipeline(transaction=False)
    for rid in request_ids:
        pipe.exists(keys.cancelled(rid))
    return {rid for rid, hit in zip(request_ids, pipe.execute(), strict=True) if hit}
