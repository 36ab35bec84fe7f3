"""The worker's I/O threads wait for a free core instead of taking one from the engine.

Linux's scheduler lets a thread that wakes up (a publisher handed a step's tokens, an
intake whose XREAD returned) preempt a thread that is computing, because the sleeper has
run less. On a CPU engine whose OpenMP team has a thread on every core, each such
preemption stalls the whole team at its next barrier: the worker's threads cost the
engine far more than their own CPU time (docs/benchmarks.md, "Fleet vs `--offline`
throughput").
SCHED_BATCH keeps a thread's fair share of the CPU but gives up that wake-up preemption,
so I/O threads run when a core frees up or the current time slice ends, a few ms at most.
The publisher is left out by default (worker/fleet/config.py, ``batch_publisher``): it
wakes between two steps, when the team's partner has nothing to compute.
"""

from __future__ import annotations

import os

import structlog

log = structlog.get_logger(__name__)


def yield_to_computing_threads() -> bool:
    """Put the calling thread under SCHED_BATCH; False where the OS has no such policy or
    refuses it (the thread then runs as before)."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        # pid 0: the calling thread alone (Linux sets policies per thread).
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as exc:
        log.debug("thread scheduling policy unchanged", error=str(exc))
        return False
    return True
