"""What one gateway process serves, and for whom."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

# Seconds a model's liveness (heartbeats) is trusted before the gateway reads it again: a
# burst of requests costs one look, and a worker's death shows within this plus its lease.
MODEL_STATE_TTL_S = 1.0
# What a 429 tells the client to wait before trying again.
RETRY_AFTER_S = 1


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
    model_state_ttl_s: float = MODEL_STATE_TTL_S
    # Generation requests answered at once (each holds a Redis connection while it waits);
    # more get 429 until one ends.
    max_concurrent: int = 512

    def __post_init__(self) -> None:
        self.api_keys = tuple(k for k in self.api_keys if k)
        if self.max_queue is not None and (not isinstance(self.max_queue, int)
                                           or self.max_queue < 1):
            raise ValueError(f"max_queue must be a positive integer, got {self.max_queue!r}")

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
