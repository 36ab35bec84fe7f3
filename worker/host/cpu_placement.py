"""Where a CPU worker's threads run when its engine's threads fill the CPUs it has.

A CPU engine's OpenMP team keeps a thread spinning on every CPU it uses (libgomp's spin
outlasts every gap in a step), so anything else that runs takes a core from one of them.
Which one matters. The engine loop's thread is the team's master: it also runs the step's
serial Python (scheduling, sampling's bookkeeping, outputs), and the team cannot start its
next region without it, so each moment it is off its core is lost in full. Its partners
take their tasks as they free up (csrc/each_task.h), so a partner that is off its core for
a moment leaves its work to the others, and between regions it only spins. Left to
itself, Linux puts a woken thread beside the thread that woke it: the publisher, handed a
step by the engine loop, lands on the master's core.

So, where the team fills the process's CPUs (at most one CPU to spare), each team thread
is pinned to a CPU of its own, the master to the first, and the worker's I/O threads
(publisher, intake, leases, heartbeat...) to the CPUs past the team, or, with none, to
the team's last (the main thread, which only waits, and the metrics server's thread are
left where they are). Placed, the engine's threads lose their cores less often and the
fleet less to the offline engine (docs/benchmarks.md, "Fleet vs `--offline` throughput").
A process with more room than that, or a team of more than two threads (MAX_TEAM), is
left to Linux. Several workers whose CPU sets overlap would pin their teams to the same
CPUs: give each its own CPU set (`taskset`, Docker's `--cpuset-cpus`), or pass
`--no-place-threads`; a CPU quota without a CPU set is not seen here either. Redis and
clients on the same machine belong on the I/O CPUs too (``taskset -p -c``); `conveyor
bench` places its own there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)


# The largest team placed. torch runs a small region on fewer threads than the team; libgomp
# then ends the threads left out and, at the next full region, makes new ones from the
# master, on the master's one CPU. A team of two never shrinks that way (a one-thread region
# leaves the pool alone); a larger one would end up on the master's CPU.
MAX_TEAM = 2


@dataclass(frozen=True)
class Placement:
    """The CPU of each OpenMP thread of the engine (the first: the engine loop's), and the
    CPUs of everything else."""

    team: tuple[int, ...]
    io: frozenset[int]


def plan(threads: int, cpus: Iterable[int] | None = None) -> Placement | None:
    """The placement for a team of ``threads`` on ``cpus`` (default: the CPUs this process
    may use), or None where there is nothing to place: fewer than two CPUs, more threads
    than CPUs, more than one CPU to spare, or a team of more than MAX_TEAM."""
    allowed = sorted(set(_allowed_cpus() if cpus is None else cpus))
    if (threads < 1 or threads > MAX_TEAM or len(allowed) < 2
            or not len(allowed) - 1 <= threads <= len(allowed)):
        return None
    team = tuple(allowed[:threads])
    return Placement(team, frozenset(allowed[threads:]) or frozenset({team[-1]}))


def pin_engine_team(placement: Placement) -> bool:
    """Pin the calling thread's OpenMP team (made now if it has none), one thread a CPU,
    the calling thread to the first; False where the kernels that do it are not built or
    a thread could not be pinned."""
    from worker.host.cpu_kernels import cpu_kernels

    module = cpu_kernels()
    if module is None:
        return False
    try:
        bound = module.bind_team(list(placement.team))
    except RuntimeError as exc:  # a CPU number the kernel cannot name
        log.warning("engine threads not placed", error=str(exc))
        return False
    if bound != len(placement.team):
        # The team was not of the planned size (the kernel then pins none) or the OS refused.
        log.warning("engine threads not placed", bound=bound, cpus=placement.team)
        return False
    return True


def pin_io_thread(placement: Placement) -> bool:
    """Keep the calling thread on the I/O CPUs; False where the OS refuses."""
    try:
        os.sched_setaffinity(0, placement.io)  # pid 0: the calling thread alone
    except (AttributeError, OSError) as exc:
        log.debug("thread not placed", error=str(exc))
        return False
    return True


def _allowed_cpus() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux: nothing is placed
        return set()
