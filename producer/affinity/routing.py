"""Where a request with affinity keys goes: the affinity lane of the live worker that holds
the deepest of its prefixes, else the shared lane (docs/affinity.md).

The producer reads the owners of the keys it looks up (one HMGET of the owners' hash of
the current generation, under the model's hash tag) and knows the live workers from the
heartbeats it reads anyway (the model check, cached for seconds). An owner that is not
live (gone, draining) counts as none: the request goes to the shared lane, and the worker
that takes it from there becomes the owner.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from producer.wire.keys import Keys

# Seconds of one generation of the owners' hashes. A worker writes a key into the
# generation of now and the next, so an advertisement is read for one to two generations
# (150-300 s) after its last write: about as long as a prefix nobody asks for stays in a
# busy worker's cache. Workers read their own clocks and name their generation in their
# heartbeats; producers read the one most of them name (a skew between workers shortens
# or lengthens that span by the skew; a producer's view lags a turn by its model check).
OWNER_GENERATION_S = 150


def generation(unix_s: float) -> int:
    """The owners' generation of a unix time (seconds)."""
    return int(unix_s // OWNER_GENERATION_S)


def owner_of(lookup: Sequence[str], owners: Sequence[bytes | str | None],
             live: Collection[str]) -> str | None:
    """The live owner of the deepest key in ``lookup`` (deepest last) that has one;
    ``owners``: what Redis holds for each key (HMGET's reply)."""
    for owner in reversed(owners):
        if owner is None:
            continue
        name = owner.decode() if isinstance(owner, bytes) else owner
        if name in live:
            return name
    return None


def lanes_counted(keys: Keys, model: str, lane: str, live: Collection[str]) -> tuple[str, ...]:
    """What ``max_queue`` counts besides the shared lane and its handoff stream: the live
    workers' affinity lanes of that lane (a dead worker's are being taken over)."""
    return tuple(keys.affinity_lane(model, worker, lane) for worker in sorted(live))
