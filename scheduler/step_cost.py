"""What a step costs, learnt from the engine's own steps, and how much prefill fits a target.

A step's time is modelled as ``a + b * prefill tokens + c * decode rows + d * context
tokens + e * chunk attention``: context, the positions each chunk's cache holds once it is
written (a decode's whole sequence; what a GPU's attention reads once a chunk); chunk
attention, what a chunk's tokens after its first attend over besides (each the context
before it and the chunk's tokens before it: the quadratic part of a long chunk, which a
CPU's attention computes token by token). The coefficients are a least-squares fit of the
steps seen so far, the older ones weighing less (a machine's speed drifts: other load,
clocks); none is negative. With an inter-token target (``SchedulerConfig.itl_target_ms``)
the scheduler asks it what the step's decodes leave of the target, and how many tokens of
each chunk fit in that, where the chunk starts: a fixed token budget cannot know what a
step costs on a given machine and model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# Each step's weight in the fit decays by this much a step: ~1,000 steps of memory.
FORGETTING = 0.999
# Steps with prefill, and steps with decodes, learnt before the fit is trusted to size
# prefill (before: the full budget); the first step of all is not learnt (a cold start).
# One prefill step is enough: beside decodes only the sums it pins are predicted (its
# chunk attention apart, which waits for a second shape of prefill step).
MIN_PREFILL_STEPS = 1
MIN_DECODE_STEPS = 2
# A tiny ridge: keeps the normal equations solvable while a feature has not varied yet.
RIDGE = 1e-9
# Prefill tokens a step holds at least while a prompt waits, however long its decodes take:
# a prompt always progresses (two blocks of 16).
MIN_PREFILL_TOKENS = 32
NUM_TERMS = 5
ATTENTION_TERM = 4


class Chunk(Protocol):
    """What the features read of a scheduled chunk (scheduler/output.py's)."""

    token_ids: list[int]
    start_position: int
    is_decode: bool


def chunk_attention(start: int, n: int) -> int:
    """What the tokens of a chunk of ``n`` at ``start`` after its first attend over
    besides the context its first reads: ``(n - 1) * (start + n / 2)``, rounded down."""
    return (n - 1) * (2 * start + n) // 2


@dataclass(frozen=True)
class StepFeatures:
    """What a step holds: prefill tokens, decode rows, context tokens, chunk attention."""

    prefill_tokens: int
    decode_rows: int
    context_tokens: int
    chunk_attention: int = 0

    @classmethod
    def of(cls, chunks: Iterable[Chunk]) -> StepFeatures:
        prefill = rows = context = attention = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            if chunk.is_decode:
                rows += 1
            else:
                prefill += n
                attention += chunk_attention(chunk.start_position, n)
            context += chunk.start_position + n
        return cls(prefill, rows, context, attention)

    def vector(self) -> np.ndarray:
        return np.array([1.0, self.prefill_tokens, self.decode_rows, self.context_tokens,
                         self.chunk_attention])


class StepCostModel:
    """Online least squares of step seconds over (1, prefill, rows, context, chunk attention)."""

    def __init__(self) -> None:
        self._xtx = np.zeros((NUM_TERMS, NUM_TERMS))
        self._xty = np.zeros(NUM_TERMS)
        # Solved at each observation and replaced whole: other threads (a metrics scrape)
        # read one consistent tuple.
        self.coefficients: tuple[float, ...] = (0.0,) * NUM_TERMS
        self._support: np.ndarray | None = None  # the terms the last fit found above zero
        # The least and most chunk attention a prefill token of a step has brought: until
        # they differ, a chunk's attention cannot be told from its tokens' own cost (one
        # step at one start splits them anyhow), and its term stays at zero.
        self._attention_seen = (math.inf, -math.inf)
        self.steps = 0
        self.prefill_steps = 0
        self.decode_steps = 0

    def observe(self, features: StepFeatures, seconds: float) -> None:
        self.steps += 1
        if self.steps == 1:
            return  # the first step pays for warming up (allocations, caches): not a cost
        x = features.vector()
        self._xtx = FORGETTING * self._xtx + np.outer(x, x)
        self._xty = FORGETTING * self._xty + x * seconds
        self.prefill_steps += features.prefill_tokens > 0
        self.decode_steps += features.decode_rows > 0
        if features.prefill_tokens > 0:
            per_token = features.chunk_attention / features.prefill_tokens
            least, most = self._attention_seen
            self._attention_seen = (min(least, per_token), max(most, per_token))
        least, most = self._attention_seen
        terms = np.ones(NUM_TERMS, dtype=bool)
        terms[ATTENTION_TERM] = most >= 1.5 * least + 1
        fit = nonnegative_fit(self._xtx, self._xty, self._support, terms)
        self._support = fit > 0
        self.coefficients = tuple(float(v) for v in fit)

    def predict(self, features: StepFeatures) -> float:
        return float(np.dot(self.coefficients, features.vector()))

    @property
    def ready(self) -> bool:
        """Whether it has seen enough steps with prefill and with decodes to size by."""
        return (self.prefill_steps >= MIN_PREFILL_STEPS
                and self.decode_steps >= MIN_DECODE_STEPS)


def nonnegative_fit(xtx: np.ndarray, xty: np.ndarray, support: np.ndarray | None = None,
                    terms: np.ndarray | None = None) -> np.ndarray:
    """The least-squares coefficients, none negative, from the normal equations (Lawson and
    Hanson's active set). A cost is never negative, and clipping an unconstrained fit is no
    fit: where a term does not vary (a steady batch's decode rows move with the intercept),
    the solve may trade one for a negative other, and clipping that one leaves the other
    far too high (a 34 ms step predicted at 95). ``support``, the terms the last fit found
    above zero, is tried first: step after step it is the same, and one solve shows it.
    ``terms``: those that may be above zero (None: all)."""
    # Each term scaled to a unit diagonal: context and chunk attention run to 10^6 and more.
    norm = np.sqrt(np.maximum(np.diag(xtx), 1e-30))
    a = xtx / np.outer(norm, norm) + RIDGE * np.eye(len(xty))
    b = xty / norm
    tol = 1e-12 * max(float(np.abs(b).max()), 1e-30)
    held = np.zeros(len(b), dtype=bool) if terms is None else ~terms
    if support is not None:
        support = support & ~held
    if support is not None and support.any():
        x = np.zeros(len(b))
        x[support] = np.linalg.solve(a[np.ix_(support, support)], b[support])
        rest = ~support & ~held
        if (x[support] > 0).all() and (not rest.any() or (b - a @ x)[rest].max() <= tol):
            return x / norm  # (the optimum's conditions hold: nothing to search)
    x, free = np.zeros(len(b)), np.zeros(len(b), dtype=bool)
    for _ in range(3 * len(b)):  # (each round frees a term; it ends in a few)
        gradient = b - a @ x
        closed = ~free & ~held
        if not closed.any() or gradient[closed].max() <= tol:
            break
        free[np.argmax(np.where(closed, gradient, -np.inf))] = True
        while True:
            z = np.zeros(len(b))
            z[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
            if (z[free] > 0).all():
                x = z
                break
            # Step from x towards z until a term reaches zero; that term is held at zero.
            back = free & (z <= 0)
            gap = x[back] - z[back]
            alpha = float(np.min(np.where(gap > 0, x[back] / np.where(gap > 0, gap, 1.0), 0.0)))
            x = x + alpha * (z - x)
            free &= x > tol
            x[~free] = 0.0
    return x / norm


def chunk_seconds(model: StepCostModel, start: int, n: int) -> float:
    """What a prefill chunk of ``n`` tokens at ``start`` adds to a step's predicted time."""
    _, b, _, d, e = model.coefficients
    return b * n + d * (start + n) + e * chunk_attention(start, n)


def prefill_within(model: StepCostModel, seconds: float, chunk_start: int, floor: int,
                   cap: int) -> int:
    """Tokens of a chunk at ``chunk_start`` whose predicted cost fits in ``seconds`` (what the
    target leaves of a step): at least ``floor`` (a prompt always progresses, even beside a
    batch that alone takes longer than the target), at most ``cap``."""
    if cap <= floor:
        return cap
    if seconds <= 0:  # (nothing left: the floor, even where the fit sees no prefill cost)
        return floor
    if chunk_seconds(model, chunk_start, cap) <= seconds:
        return cap
    lo, hi = floor, cap  # lo: allowed (it fits, or it is the floor); hi: does not fit
    while hi - lo > 1:  # (the cost only grows with n: no term is negative)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if chunk_seconds(model, chunk_start, mid) <= seconds else (lo, mid)
    return lo
