"""Sampling randomness as a pure function of (seed, token index).

A request's draw for output token ``i`` never depends on the batch it lands
in, the step it runs in, or the worker that runs it: a request restarted from
its prompt plus its first ``k`` tokens continues exactly as before.
"""

from __future__ import annotations

import hashlib
import secrets

import numpy as np

MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    # A fixed, well-mixed 64-bit permutation: consecutive inputs give unrelated outputs.
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform(seed: int, index: int) -> float:
    """A uniform draw in [0, 1) determined by ``seed`` and ``index`` alone."""
    x = splitmix64(splitmix64(seed & MASK64) ^ (index & MASK64))
    return (x >> 11) * (1.0 / (1 << 53))


def uniforms(seeds: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """:func:`uniform` of each (seed, index) pair, vectorised: float64, bit for bit the same.

    ``seeds`` and ``indices`` are uint64 arrays (the values modulo 2**64): numpy's uint64
    arithmetic wraps as the reference's masks do, and its right shifts are logical. numpy,
    not torch: a batch's ~30 small ops cost ~1 us each here against 5-10 us each as torch
    ops, and the draws go to the device with the rest of the step's values.
    """
    with np.errstate(over="ignore"):
        x = _splitmix64_array(_splitmix64_array(seeds) ^ indices)
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def fresh_seed() -> int:
    """A seed for a request that did not ask for one (kept, so it can resume exactly)."""
    return secrets.randbits(63)


def stable_seed(request_id: str) -> int:
    """A sampling seed derived from the request id (the same on every worker): an unseeded
    request resumed elsewhere draws the same tokens."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest()) >> 1
