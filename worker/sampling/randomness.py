"""Sampling randomness as a pure function of (seed, token index).

A request's draw for output token ``i`` never depends on the batch it lands
in, the step it runs in, or the worker that runs it: a request restarted from
its prompt plus its first ``k`` tokens continues exactly as before.
"""

from __future__ import annotations

import secrets

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # A fixed, well-mixed 64-bit permutation: consecutive inputs give unrelated outputs.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, index: int) -> float:
    """A uniform draw in [0, 1) determined by ``seed`` and ``index`` alone."""
    x = _splitmix64(_splitmix64(seed & _MASK64) ^ (index & _MASK64))
    return (x >> 11) * (1.0 / (1 << 53))


def fresh_seed() -> int:
    """A seed for a request that did not ask for one (kept, so it can resume exactly)."""
    return secrets.randbits(63)
