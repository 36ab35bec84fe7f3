"""The simulated forward: an instrument to run the fleet at a GPU's speed on any machine.

A simulated engine runs everything of a real one (admission, scheduling, block accounting,
the prefix cache, preemption, detokenizing, stop strings) and everything of a worker around
it, but not the forward: ``SimulatedRunner`` stands where ``ModelRunner`` stands, allocates
no weights and no KV tensors, and finishes each step ``StepCost.step_ms`` after the step
was launched. It waits without the GIL, so with overlapped steps (on by default for a
simulated engine) the host schedules the next step meanwhile, as it does beside a GPU.

Its tokens are not a model's: token ``i`` of a request with seed ``s`` is
:func:`simulated_token` ``(s, i, vocab_size, eos_ids)``, a pure function any test or reader
can compute, drawn from the vocabulary less the end-of-sequence ids (so a request runs to
``max_tokens`` unless a stop token or stop string ends it). Sampling settings do not change
it; a request that asks for log-probabilities (which need logits) is refused.

The step time follows ``a + b * prefill tokens + c * decode rows + d * context tokens``
(milliseconds): ``a`` the fixed cost of a step (launches, the weights read once), ``b`` a
prompt token computed, ``c`` a decoding request's row, ``d`` a token of KV read by attention.
``--simulate-step-ms MS`` sets ``a`` alone; ``--simulate-cost`` takes a JSON file with the
four or a preset's name (PRESETS; docs/benchmarks.md shows how ``h200-8b`` was fitted).
"""

from __future__ import annotations

import json
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from producer.clock import SYSTEM_CLOCK, Clock
from producer.wire.completion import TokenLogprob
from scheduler.output import SchedulerOutput
from worker.sampling.randomness import MASK64, splitmix64


def simulated_token(seed: int, index: int, vocab_size: int,
                    excluded: Iterable[int] = ()) -> int:
    """Token ``index`` (0 = the first output token) of a simulated request with ``seed``:
    ``r = splitmix64((seed * 2**32 + index) mod 2**64)``, taken modulo the number of
    allowed ids, then counted up past each excluded id (ascending) it reaches: uniform over
    ``range(vocab_size)`` less ``excluded`` (its end-of-sequence ids)."""
    skip, allowed = _drawn_from(vocab_size, excluded)
    token = splitmix64(((seed << 32) + index) & MASK64) % allowed
    for e in skip:
        if token >= e:
            token += 1
    return token


def _drawn_from(vocab_size: int, excluded: Iterable[int]) -> tuple[list[int], int]:
    """The excluded ids inside the vocabulary, ascending, and how many ids are left."""
    skip = sorted({e for e in excluded if 0 <= e < vocab_size})
    allowed = vocab_size - len(skip)
    if allowed < 1:
        raise ValueError("the vocabulary has no token that is not excluded")
    return skip, allowed


def simulated_tokens(seeds: list[int], indexes: list[int], vocab_size: int,
                     excluded: Iterable[int] = ()) -> list[int]:
    """:func:`simulated_token` of each (seed, index) pair, the same values, in one pass of
    uint64 arithmetic (a step's rows at once: the runner thread holds the GIL the host's
    other threads need for as short as it can)."""
    skip, allowed = _drawn_from(vocab_size, excluded)
    x = ((np.array([s & MASK64 for s in seeds], dtype=np.uint64) << np.uint64(32))
         + np.array(indexes, dtype=np.uint64))  # both wrap modulo 2**64, as MASK64 does
    x += np.uint64(0x9E3779B97F4A7C15)  # splitmix64, in place
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    token = (x ^ (x >> np.uint64(31))) % np.uint64(allowed)
    for e in skip:
        token += token >= np.uint64(e)
    return token.tolist()


@dataclass(frozen=True)
class StepCost:
    """How long a simulated step takes, in milliseconds (see the module docstring)."""

    base_ms: float = 0.0  # a: every step
    prefill_token_ms: float = 0.0  # b: each prompt token computed
    decode_row_ms: float = 0.0  # c: each request decoding one token
    context_token_ms: float = 0.0  # d: each token of KV that attention reads

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if (not isinstance(value, int | float) or isinstance(value, bool)
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"step cost {f.name} must be a number of ms >= 0, got "
                                 f"{value!r}")

    def step_ms(self, prefill_tokens: int, decode_rows: int, context_tokens: int) -> float:
        return (self.base_ms + self.prefill_token_ms * prefill_tokens
                + self.decode_row_ms * decode_rows + self.context_token_ms * context_tokens)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def load(cls, spec: str) -> StepCost:
        """A preset's name (PRESETS), or a JSON file with some of the four fields."""
        if spec in PRESETS:
            return PRESETS[spec]
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"--simulate-cost must be a preset ({', '.join(PRESETS)}) or a "
                             f"JSON file, got {spec!r}")
        try:
            values = json.loads(path.read_text())
        except ValueError as exc:
            raise ValueError(f"{spec}: not JSON: {exc}") from None
        names = {f.name for f in fields(cls)}
        if not isinstance(values, dict) or set(values) - names:
            raise ValueError(f"{spec}: a JSON object with some of {', '.join(sorted(names))}")
        return cls(**values)


# Fitted to an 8B model on one H200 (~17,700 output tokens/s at 1000/1000 tokens and ~27,900
# at 128/128, batches of 256): docs/benchmarks.md, "The simulated engine".
PRESETS = {
    "h200-8b": StepCost(base_ms=4.0, prefill_token_ms=0.012, decode_row_ms=0.005,
                        context_token_ms=0.0000158),
}


def step_cost(step_ms: float | None, cost: str | None) -> StepCost | None:
    """The engine's StepCost from its settings (None: a real engine)."""
    if step_ms is not None and cost is not None:
        raise ValueError("give --simulate-step-ms or --simulate-cost, not both")
    if step_ms is not None:
        return StepCost(base_ms=step_ms)
    return StepCost.load(cost) if cost is not None else None


class SimulatedRunner:
    """Stands where ModelRunner stands (``execute``, ``release``, the counters), without a
    model: each sampling chunk gets its :func:`simulated_token`, ``step_ms`` after launch."""

    def __init__(self, cost: StepCost, vocab_size: int, eos_token_ids: Iterable[int],
                 clock: Clock | None = None) -> None:
        self.cost = cost
        self.vocab_size = vocab_size
        self.excluded = sorted(set(eos_token_ids))
        self.clock = clock or SYSTEM_CLOCK
        self.on_forward: Callable[[], object] | None = None
        self._seeds: dict[str, int] = {}
        self._never = threading.Event()  # nothing sets it: each wait lasts its timeout
        self.num_forwards = 0
        self.num_computed_tokens = 0
        self.grammar_failures: dict[str, str] = {}  # (none: constraints are refused)
        # Simulated milliseconds of every step so far (what a GPU would have been busy).
        self.simulated_ms = 0.0
        # When each step handed to the runner thread and not yet run was handed over (in
        # order), and when the device is done with the last step it started.
        self._handed_over: deque[float] = deque()
        self._device_free_at = 0.0

    def queued(self, out: SchedulerOutput) -> None:
        """The engine hands ``out`` to the runner thread now (before ``execute``): on a GPU
        its kernels would be queued on the device's stream now."""
        self._handed_over.append(self.clock.monotonic())

    def execute(self, out: SchedulerOutput, pending: dict[str, int] | None = None,
                ) -> tuple[dict[str, int], dict[str, TokenLogprob | None], dict]:
        # When the engine handed this step over (queued; a plain step: now). Taken first,
        # so that a step with nothing to compute (swaps only) leaves none behind.
        now = self.clock.monotonic()
        handed_over = self._handed_over.popleft() if self._handed_over else now
        self.release(out)
        for new in out.new_requests:
            self._seeds[new.request_id] = new.seed
        chunks = out.chunks
        if not chunks:
            return {}, {}, {}
        prefill = sum(c.num_tokens for c in chunks if not c.is_decode)
        decodes = sum(1 for c in chunks if c.is_decode)
        context = sum(c.start_position + c.num_tokens for c in chunks)
        ms = self.cost.step_ms(prefill, decodes, context)
        # A device runs the steps handed to it back to back: this one starts when the one
        # before it ended or when the engine handed it over, whichever is later, however
        # late this thread comes to it.
        start = max(handed_over, self._device_free_at)
        self._device_free_at = end = start + ms / 1000
        if self.on_forward is not None:
            self.on_forward()
        sampled = [c for c in chunks if c.sample]
        tokens = dict(zip([c.request_id for c in sampled], simulated_tokens(
            [self._seeds[c.request_id] for c in sampled], [c.output_index for c in sampled],
            self.vocab_size, self.excluded), strict=True))
        self.num_forwards += 1
        self.num_computed_tokens += prefill + decodes
        self.simulated_ms += ms
        left = end - self.clock.monotonic()
        if left > 0:
            self.clock.wait(self._never, left)
        return tokens, dict.fromkeys(tokens), {}

    def release(self, out: SchedulerOutput) -> None:
        for request_id in (*out.finished_ids, *out.preempted_ids):
            self._seeds.pop(request_id, None)
