"""What a step costs, learnt from the engine's own steps, and how much prefill fits a target.

A step's time is modelled as ``a + b * prefill tokens + c * decode rows + d * context
tokens`` (context: the positions its chunks attend over). The coefficients are a least-
squares fit of the steps seen so far, the older ones weighing less (a machine's speed
drifts: other load, clocks). The scheduler asks it how many prefill tokens fit beside the
step's decodes when an inter-token target is set (``SchedulerConfig.itl_target_ms``): a
fixed token budget cannot know what a step costs on a given machine and model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Each step's weight in the fit decays by this much a step: ~1,000 steps of memory.
FORGETTING = 0.999
# Steps with prefill, and steps with decodes, learnt before the fit is trusted to size
# prefill (before: the full budget); the first step of all is not learnt (a cold start).
# One prefill step is enough: beside decodes only the sums it pins are predicted.
MIN_PREFILL_STEPS = 1
MIN_DECODE_STEPS = 2
# A tiny ridge: keeps the normal equations solvable while a feature has not varied yet.
RIDGE = 1e-9
# Prefill tokens a step holds at least while a prompt waits, however long its decodes take:
# a prompt always progresses (two blocks of 16).
MIN_PREFILL_TOKENS = 32


@dataclass(frozen=True)
class StepFeatures:
    """What a step holds: prefill tokens, decode rows, context tokens."""

    prefill_tokens: int
    decode_rows: int
    context_tokens: int

    def vector(self) -> np.ndarray:
        return np.array([1.0, self.prefill_tokens, self.decode_rows, self.context_tokens])


class StepCostModel:
    """Online least squares of step seconds over (1, prefill, rows, context)."""

    def __init__(self) -> None:
        self._xtx = np.zeros((4, 4))
        self._xty = np.zeros(4)
        # Solved at each observation and replaced whole: other threads (a metrics scrape)
        # read one consistent tuple.
        self.coefficients: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
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
        scale = np.maximum(np.diag(self._xtx), 1.0)
        coef = np.linalg.solve(self._xtx + RIDGE * np.diag(scale), self._xty)
        # (a cost is never negative; a term the data cannot tell apart yet counts as none)
        self.coefficients = tuple(float(max(v, 0.0)) for v in coef)  # type: ignore[assignment]

    def predict(self, features: StepFeatures) -> float:
        return float(np.dot(self.coefficients, features.vector()))

    @property
    def ready(self) -> bool:
        """Whether it has seen enough steps with prefill and with decodes to size by."""
        return (self.prefill_steps >= MIN_PREFILL_STEPS
                and self.decode_steps >= MIN_DECODE_STEPS)


def prefill_within(model: StepCostModel, target_s: float, decode_rows: int,
                   context_tokens: int, floor: int, cap: int) -> int:
    """Prefill tokens a step may hold beside ``decode_rows`` decodes over
    ``context_tokens`` so that its predicted time stays within ``target_s``: at least
    ``floor`` (a prompt always progresses, even beside a batch that alone takes longer),
    at most ``cap``; ``cap`` while the model is not ready."""
    if not model.ready:
        return cap
    a, b, c, d = model.coefficients
    room = target_s - a - c * decode_rows - d * context_tokens
    per_token = b + d  # each prefill token is also a position attended over
    if per_token <= 0:  # (prefill costs nothing the fit can see: only the rest decides)
        return cap if room > 0 else floor
    return max(floor, min(cap, int(room / per_token)))
