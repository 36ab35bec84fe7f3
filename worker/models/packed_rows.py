"""Up to how many rows a decode step's matmuls take the packed kernel: chosen by timing it on
the host, not fixed in the code.

Whether the packed kernel (csrc/packed_linear.cpp) beats the unpacked matmuls (the skinny
kernel, then oneDNN's) at a row count depends on the CPU it runs on. On the host of stops
26-28 it won at every count it serves (0.4-0.9x oneDNN's time up to 192 rows); on stop 30's,
whose BLAS and oneDNN run ~1.7x faster, it lost past ~32 rows, and the decode step at batch 64
took 41 ms packed against 30 ms without (docs/benchmarks.md, decode step section). So when a
CPU engine is built, one decoder layer's four weight matmuls (fused q/k/v, o, fused gate/up,
down) are timed packed and unpacked, in turn, at growing row counts; the packed kernel serves
steps up to the count before the first one at which it was slower by more than ``TIE``.
Within that it counts as no slower: one layer at a few rows takes ~1 ms, whose timing
swings by a few percent here, and the packed copies are what lets the step run as one region
whose master takes over a late thread's panels (csrc/step_team.h), which a worker that
shares its cores needs.

``CONVEYOR_PACKED_MAX_ROWS`` sets the limit instead of the timing (to compare, or to skip
the ~0.1-0.3 s it takes on the small preset).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch

ENV_LIMIT = "CONVEYOR_PACKED_MAX_ROWS"
# Row counts timed, in order (the packed kernel serves at most 192 rows: kPackedMaxRows).
ROWS = (8, 16, 32, 48, 64, 96, 128, 192)
# Each side's time at a row count is its best of this many turns; a turn repeats the
# matmuls until it has done about REPEAT_ROWS rows' worth (a few ms on the small preset),
# so that small counts are not timed on a single ~1 ms run.
ROUNDS = 5
REPEAT_ROWS = 64
# Packed at up to this many times the unpacked time still counts as no slower.
TIE = 1.05

Matmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], object]


def from_environment() -> int | None:
    """The limit ``CONVEYOR_PACKED_MAX_ROWS`` sets, or None where it is unset or empty."""
    raw = os.environ.get(ENV_LIMIT, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_LIMIT} must be a whole number of rows, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{ENV_LIMIT} must be 0 or more rows, got {value}")
    return value


def timed_limit(weights: Sequence[torch.Tensor], packed: Sequence[torch.Tensor],
                matmul: Matmul, clock: Callable[[], float] = time.perf_counter,
                rows: Sequence[int] = ROWS, rounds: int = ROUNDS) -> int:
    """The most rows (of ``rows``) up to which ``matmul`` over ``weights`` with their
    ``packed`` copies took at most ``TIE`` times as long as without them, at that count and
    every smaller one; 0 where they lost at the first count. ``matmul(x, weight,
    packed_or_None)``."""
    if len(weights) != len(packed):
        raise ValueError("one packed copy per weight")
    gen = torch.Generator().manual_seed(0)
    limit = 0
    for count in rows:
        inputs = {w.shape[1]: torch.randn(count, w.shape[1], generator=gen, device=w.device)
                  for w in weights}
        best = {True: float("inf"), False: float("inf")}
        for turn in range(rounds + 1):  # turn 0 is not timed: first calls set kernels up
            for use_packed in (True, False):  # in turn, so both see the same machine
                start = clock()
                for _ in range(max(1, REPEAT_ROWS // count)):
                    for w, p in zip(weights, packed, strict=True):
                        matmul(inputs[w.shape[1]], w, p if use_packed else None)
                if turn:
                    best[use_packed] = min(best[use_packed], clock() - start)
        if best[True] > TIE * best[False]:
            break
        limit = count
    return limit
