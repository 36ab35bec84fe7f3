"""CPU seconds the processes of a run used: says where a 2-core machine's time went."""

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


def redis_cpu_s(client: redis.Redis) -> float | None:
    """User + system CPU seconds of the Redis server so far; None when INFO is refused."""
    try:
        info = client.info("cpu")
    except redis.RedisError:
        return None
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def delta(before: float | None, after: float | None) -> float | None:
    return round(after - before, 3) if before is not None and after is not None else None
