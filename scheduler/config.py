"""Scheduler limits, each with its meaning and default in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass

# How a preempted request gives up its device KV (see SchedulerConfig.preemption_mode).
PREEMPTION_MODES = ("auto", "swap", "recompute")


def check_preemption_mode(mode: object) -> str:
    """``mode`` unchanged when it is one of PREEMPTION_MODES, else a ValueError."""
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                         f"got {mode!r}")
    return mode


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits on what one engine step may contain."""

    # Tokens computed in one step across all requests (decodes count one each).
    max_num_batched_tokens: int = 1024
    # Requests running at once (holding KV and scheduled every step). 64, not more: on this
    # project's CPU reference a batch past 64 adds no throughput but doubles ITL p90, and a
    # worker that takes fewer leaves more queued requests to idle workers (docs/benchmarks.md).
    max_num_seqs: int = 64
    # Largest prefill chunk of one request in one step; None means the whole budget.
    max_prefill_chunk: int | None = None
    # Off: a prompt is prefilled in one step or waits; the budget must then hold max_model_len.
    enable_chunked_prefill: bool = True
    # Longest sequence (prompt + output) a request may reach.
    max_model_len: int = 2048
    # How a preempted request gives up its device KV: "auto" swaps to the host tier when
    # it has room and the request has computed at least a block (less is cheaper to
    # recompute), else recomputes; "swap" swaps whenever the host has room; "recompute" never swaps.
    preemption_mode: str = "auto"
    # Inter-token target (ms): while requests decode, a step holds only as many prefill
    # tokens as keep its predicted time within it (scheduler/step_cost.py: a cost model of
    # the engine's own steps); at least MIN_PREFILL_TOKENS, so a prompt always progresses.
    # None or 0: the token budget alone. Needs chunked prefill. Off by default: where a decode
    # step is compute-bound (a CPU) it bounds ITL at the price of a long prompt's TTFT and of
    # throughput (docs/benchmarks.md: W2 and W1 with an inter-token target).
    itl_target_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_preemption_mode(self.preemption_mode)
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running request decodes one token a step: a smaller budget would leave
            # some of them out of every step, and which ones would depend on their order.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): a step holds one token of every "
                "running request")
        if self.itl_target_ms is not None and not 0 <= self.itl_target_ms < math.inf:
            raise ValueError(f"itl_target_ms must be a finite number >= 0 (0: off), got "
                             f"{self.itl_target_ms}")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be >= 1, got {self.max_prefill_chunk}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "with chunked prefill off, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )

    @property
    def chunk_cap(self) -> int:
        return self.max_prefill_chunk or self.max_num_batched_tokens
