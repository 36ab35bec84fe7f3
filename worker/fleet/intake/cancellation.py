"""Cancellations: a pub/sub listener, and the marker keys for requests not yet seen."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import redis
import structlog

from producer.wire.keys import Keys
from producer.wire.validation import request_of
from worker.fleet.supervised import SupervisedThread

log = structlog.get_logger(__name__)


class CancelListener(SupervisedThread):
    """Subscribes to the cancel channel and forwards each id to ``on_cancel``."""

    def __init__(self, client: redis.Redis, keys: Keys, on_cancel: Callable[[str], None],
                 worker_id: str, inflight_ids: Callable[[], list[str]] = list,
                 **supervision: Any) -> None:
        super().__init__("cancel-listener", worker_id=worker_id, **supervision)
        self.client = client
        self.keys = keys
        self.on_cancel = on_cancel
        # The requests this worker serves: their markers are checked after each subscribe.
        self.inflight_ids = inflight_ids
        self.subscribed = threading.Event()

    def tick(self) -> None:
        """Subscribe and forward messages until stopped or the connection fails."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(self.keys.cancel_channel)
            # Announcements sent while no subscription was up are lost: their markers are not.
            # (by request: a request's choices, "{id}.{i}", share its marker)
            requests = list(dict.fromkeys(request_of(rid) for rid in self.inflight_ids()))
            for rid in cancelled_ids(self.client, self.keys, requests):
                self.on_cancel(rid)
            self.subscribed.set()
            self.working()
            while not self.stopping.is_set():
                msg = pubsub.get_message(timeout=0.5)
                if msg and msg.get("type") == "message":
                    data = msg["data"]
                    self.on_cancel(data.decode() if isinstance(data, bytes) else str(data))
        finally:
            self.subscribed.clear()
            pubsub.close()


def cancelled_ids(client: redis.Redis, keys: Keys, request_ids: list[str]) -> set[str]:
    """Which of these requests carry a cancellation marker (cancelled before we read them)."""
    if not request_ids:
        return set()
    pipe = client.pipeline(transaction=False)
    for rid in request_ids:
        pipe.exists(keys.cancelled(rid))
    return {rid for rid, hit in zip(request_ids, pipe.execute(), strict=True) if hit}
