"""A producer's watch: requests tied to the life of the process that asked for them.

A producer that opts in (``Client(watch=True)``, every gateway) keeps one key alive,
``{ns}:watch:{id}``, set with a TTL of WATCH_TTL_S and renewed every WATCH_RENEW_S, and
marks each request it submits with the id. A worker cancels a marked request once its
watch key is gone (worker/fleet/housekeeping/leases.py): the producer died, and nobody
will read the answer. A producer that stops renewing (killed, or cut off from Redis for
longer than the TTL) thereby cancels what it asked for within about WATCH_TTL_S plus a
worker's check interval (a third of its lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from typing import Any

import redis
import structlog

from producer.wire.keys import Keys

log = structlog.get_logger(__name__)

# Seconds a watch key lives without renewal (a longer one rides out longer stalls of its
# producer, a shorter one cancels an orphan sooner); it is renewed four times a TTL.
WATCH_TTL_S = 20
RENEWALS_PER_TTL = 4
WATCH_RENEW_S = WATCH_TTL_S / RENEWALS_PER_TTL


def check_watch_ttl(ttl_s: object) -> int:
    """A watch TTL: a whole number of seconds >= 1, else ValueError."""
    if not isinstance(ttl_s, int) or isinstance(ttl_s, bool) or ttl_s < 1:
        raise ValueError(f"a watch's TTL is a whole number of seconds >= 1, got {ttl_s!r}")
    return ttl_s


class _WatchBase:
    def __init__(self, keys: Keys, ttl_s: int = WATCH_TTL_S,
                 renew_s: float | None = None, watch_id: str | None = None) -> None:
        check_watch_ttl(ttl_s)
        renew_s = ttl_s / RENEWALS_PER_TTL if renew_s is None else renew_s
        if not 0 < renew_s < ttl_s:
            raise ValueError(f"a watch is renewed (every {renew_s!r} s) well within its TTL "
                             f"({ttl_s!r} s)")
        # A fresh id, or one given: a producer that takes over another's work (a retried
        # bulk job) keeps the requests it finds alive by renewing their watch.
        self.id = uuid.uuid4().hex if watch_id is None else watch_id
        self.key = keys.watch(self.id)  # validates a given id
        self.ttl_s = ttl_s
        self.renew_s = renew_s
        # Renewals that failed (Redis unreachable): the next one tries again.
        self.failures = 0

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        log.warning("watch key not renewed: requests this producer marked are cancelled if "
                    "it stays so", key=self.key, error=str(exc))


class WatchKeeper(_WatchBase):
    """Keeps the watch key alive from a daemon thread, for a synchronous Client."""

    def __init__(self, client: redis.Redis, keys: Keys, **timing: Any) -> None:
        super().__init__(keys, **timing)
        self.client = client
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Set the key now (the first request's watch exists before the request does),
        then keep it alive."""
        self.client.set(self.key, b"1", ex=self.ttl_s)
        self._thread = threading.Thread(target=self._run, name="conveyor-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                self.client.set(self.key, b"1", ex=self.ttl_s)
            except Exception as exc:  # noqa: BLE001 (a stopped renewal cancels requests)
                self._failed(exc)

    def stop(self) -> None:
        """Stop renewing: the key lapses within its TTL (and the requests marked with it
        are cancelled then, unless they ended)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)


class AsyncWatchKeeper(_WatchBase):
    """Keeps the watch key alive from an asyncio task, for an AsyncClient."""

    def __init__(self, client: Any, keys: Keys, **timing: Any) -> None:
        super().__init__(keys, **timing)
        self.client = client
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.client.set(self.key, b"1", ex=self.ttl_s)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.renew_s)
            try:
                await self.client.set(self.key, b"1", ex=self.ttl_s)
            except Exception as exc:  # noqa: BLE001 (a stopped renewal cancels requests)
                self._failed(exc)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
