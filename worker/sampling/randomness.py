"""Sampling randomness as a pure function of (seed, token index).

A request's draw for output token ``i`` never depends on the batch it lands
in, the step it runs in, or the worker that runs it: a request restarted from
its prompt plus its first ``k`` tokens continues exactly as before.
"""

from __future__ import annotations

import secrets

import torch

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


def uniforms(seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """:func:`uniform` of each (seed, index) pair, vectorised: float64, bit for bit the same.

    ``seeds`` and ``indices`` are int64 tensors holding the 64-bit values in two's
    complement (:func:`as_int64`); int64 arithmetic wraps modulo 2**64 as the reference's
    masks do, and right shifts are made logical by masking off the copied sign bits.
    """
    x = _splitmix64_tensor(_splitmix64_tensor(seeds) ^ indices)
    return _shift_right(x, 11).to(torch.float64) * (1.0 / (1 << 53))


def as_int64(value: int) -> int:
    """A 64-bit value (taken modulo 2**64) as the int64 with the same bits."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    x = x + as_int64(0x9E3779B97F4A7C15)
    x = (x ^ _shift_right(x, 30)) * as_int64(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * as_int64(0x94D049BB133111EB)
    return x ^ _shift_right(x, 31)


def fresh_seed() -> int:
    """A seed for a request that did not ask for one (kept, so it can resume exactly)."""
    return secrets.randbits(63)
