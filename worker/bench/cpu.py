"""CPU seconds the processes of a run used, and how often their threads were preempted:
says where a 2-core machine's time went."""

from __future__ import annotations

import os
from pathlib import Path

import redis


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process so far (Linux /proc); None when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def process_preemptions(pid: int) -> int | None:
    """Times the OS took a core from a thread of process ``pid`` that could still run
    (involuntary context switches, summed over its threads; Linux /proc); None when unknown.

    An engine's OpenMP team is as fast as its slowest thread: each time another process or
    thread takes a core from one of them, the others wait at the next barrier. This count is
    how often that happened (the fleet's worker against the offline engine, same steps).
    """
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    total = 0
    for task in tasks:
        try:
            status = (task / "status").read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        for line in status.splitlines():
            if line.startswith("nonvoluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def redis_cpu_s(client: redis.Redis) -> float | None:
    """User + system CPU seconds of the Redis server so far; None when INFO is refused."""
    try:
        info = client.info("cpu")
    except redis.RedisError:
        return None
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def delta(before: float | None, after: float | None) -> float | None:
    """``after - before`` (to the millisecond for seconds; counts stay ints); None when
    either is unknown."""
    return round(after - before, 3) if before is not None and after is not None else None
