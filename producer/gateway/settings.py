"""What one gateway process serves, and for whom."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

from producer.client.watch import WATCH_TTL_S

# Seconds a model's liveness (heartbeats) is trusted before the gateway reads it again: a
# burst of requests costs one look, and a worker's death shows within this plus its lease.
MODEL_STATE_TTL_S = 1.0
# What a 429 tells the client to wait before trying again.
RETRY_AFTER_S = 1
# A stream that waits sends an SSE comment this often, so that it is never silent for
# longer (proxies cut idle connections, often after 30-60 s).
KEEPALIVE_S = 10.0
# A request whose model has had no live worker this long is cancelled and answered with
# `no_live_worker`, rather than waiting for a worker that may never come.
ORPHAN_TIMEOUT_S = 60.0
# Generation requests answered at once; more get 429 `gateway_busy` until one ends.
MAX_CONCURRENT = 512
# Redis connections of one gateway process, and how many of them read the answers' streams
# for every request at once (producer/gateway/shared_reads.py); the rest submit, cancel and
# look at the models.
REDIS_CONNECTIONS = 64
READ_CONNECTIONS = 8
# Open client connections (one past them is closed at once), and how long a client may take
# to send a request's headers, then its body, and stay idle between requests on a kept-alive
# one.
MAX_CONNECTIONS = 4096
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
KEEPALIVE_TIMEOUT_S = 5.0


@dataclass
class GatewaySettings:
    """Settings of `conveyor gateway` (each flag of the verb sets one)."""

    redis_url: str | None = None
    namespace: str = "conveyor"
    # Bearer tokens accepted on /v1/*; none: no authentication (a trusted network only).
    api_keys: tuple[str, ...] = ()
    # Refuse (429) a request whose lane already holds this many waiting; None: no bound.
    max_queue: int | None = None
    # Lane of the requests this gateway submits (interactive: people wait on them).
    lane: str = "interactive"
    # The most urgent priority a client may ask for (lower is more urgent): by default none
    # goes ahead of requests that ask for nothing; an operator who trusts its clients
    # lowers it (to -1000, the wire's bound, for vLLM's whole range).
    min_priority: int = 0
    model_state_ttl_s: float = MODEL_STATE_TTL_S
    # Generation requests answered at once; more get 429 until one ends.
    max_concurrent: int = MAX_CONCURRENT
    # Redis connections in all, and those of them that read every request's stream.
    redis_connections: int = REDIS_CONNECTIONS
    read_connections: int = READ_CONNECTIONS
    max_connections: int = MAX_CONNECTIONS
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S
    keepalive_s: float = KEEPALIVE_S
    # Seconds this gateway's watch outlives it: its requests are cancelled that long after
    # it dies (producer/client/watch.py).
    watch_ttl_s: int = WATCH_TTL_S
    # None: wait for a worker however long it takes.
    orphan_timeout_s: float | None = ORPHAN_TIMEOUT_S
    # Prefix affinity: requests go to the worker that holds their prompt's prefix
    # (producer/affinity/); False sends every request to its model's shared lane.
    affinity: bool = True

    def __post_init__(self) -> None:
        self.api_keys = tuple(k for k in self.api_keys if k)
        if not isinstance(self.watch_ttl_s, int) or self.watch_ttl_s < 1:
            raise ValueError(f"watch_ttl_s must be a whole number of seconds >= 1, got "
                             f"{self.watch_ttl_s!r}")
        if not self.keepalive_s > 0:
            raise ValueError(f"keepalive_s must be > 0, got {self.keepalive_s!r}")
        if self.orphan_timeout_s is not None and not self.orphan_timeout_s > 0:
            raise ValueError(f"orphan_timeout_s must be > 0 or None, got "
                             f"{self.orphan_timeout_s!r}")
        if not isinstance(self.min_priority, int) or not -1000 <= self.min_priority <= 1000:
            raise ValueError(f"min_priority must be an integer in [-1000, 1000], got "
                             f"{self.min_priority!r}")
        if self.max_queue is not None and (not isinstance(self.max_queue, int)
                                           or self.max_queue < 1):
            raise ValueError(f"max_queue must be a positive integer, got {self.max_queue!r}")
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_concurrent", "redis_connections", "read_connections",
                     "max_connections"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.redis_connections <= self.read_connections:
            raise ValueError(f"redis_connections ({self.redis_connections}) must be more than "
                             f"read_connections ({self.read_connections}): the readers hold "
                             "theirs while they wait, and submits need some")

    def key_accepted(self, presented: str | None) -> bool:
        """Whether ``presented`` is one of the keys (constant time per key)."""
        if not self.api_keys:
            return True
        if not presented:
            return False
        given = presented.encode()
        return any(hmac.compare_digest(given, k.encode()) for k in self.api_keys)


def read_key_file(path: str | Path) -> tuple[str, ...]:
    """API keys from a file, one per line (blank lines and ``#`` comments skipped)."""
    keys = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    if not keys:
        raise ValueError(f"{path} holds no API key")
    return tuple(keys)
