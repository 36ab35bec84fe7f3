"""CPU seconds the processes of a run used, how often their threads were preempted, and the
CPU time the host took from this machine: says where a 2-core machine's time went."""

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


def stolen_cpu_s() -> float | None:
    """CPU seconds the hypervisor gave to others while this machine's CPUs had work, so far,
    all CPUs together (the ``steal`` column of Linux's /proc/stat); None when unknown.

    On a virtual machine whose host is busy, a run's CPUs stop for moments it cannot see:
    an OpenMP team waits at every barrier for a thread whose CPU was taken, so a few percent
    of steal slows an engine step by more than that. A run with much of it measured the
    host, not the code (docs/benchmarks.md, "The machines and their noise").
    """
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # "cpu user nice system idle iowait irq softirq steal ...": steal is the 8th number.
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def idle_cpu_s() -> list[float] | None:
    """Seconds each CPU of this machine has been idle so far (idle + iowait, Linux's
    /proc/stat), in CPU order; None when unknown.

    An engine whose threads fill the CPUs keeps them busy from its first step to its last:
    a CPU idle during a run is a thread of the team that was off it, waiting for something
    (a lock, the GIL, a barrier it slept at), with nothing else to run there.
    """
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line[:3] == "cpu" and line[3].isdigit()]
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    try:
        return [(int(f[4]) + int(f[5])) / tick for f in lines] or None
    except (IndexError, ValueError):
        return None


def idle_delta(before: list[float] | None, after: list[float] | None) -> list[float] | None:
    """Each CPU's idle seconds between two ``idle_cpu_s`` readings (to the millisecond)."""
    if before is None or after is None or len(before) != len(after):
        return None
    return [round(a - b, 3) for a, b in zip(after, before, strict=True)]


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


def thread_cpu_s(pid: int) -> dict[int, tuple[str, float]] | None:
    """Each live thread of process ``pid``: its OS name and its user + system CPU seconds so
    far (Linux /proc); None when the process is unknown. A worker's threads carry their own
    names (worker/fleet/thread_names.py); its OpenMP team, the engine loop's."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    threads: dict[int, tuple[str, float]] = {}
    for task in tasks:
        try:
            # Names are any bytes another process chose (half a character, say).
            stat = (task / "stat").read_text(errors="replace")
        except OSError:
            continue  # a thread that ended meanwhile
        # "tid (name) state ...": the name may hold spaces and parentheses.
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        threads[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return threads


def threads_delta(before: dict[int, tuple[str, float]] | None,
                  after: dict[int, tuple[str, float]] | None) -> dict[str, float] | None:
    """CPU seconds by thread name between two ``thread_cpu_s`` readings, the threads of one
    name summed; a thread started in between counts from zero, one that ended is not seen.
    None when either reading is unknown."""
    if before is None or after is None:
        return None
    used: dict[str, float] = {}
    for tid, (name, seconds) in after.items():
        start = before.get(tid)
        spent = seconds - (start[1] if start is not None and start[0] == name else 0.0)
        used[name] = used.get(name, 0.0) + spent
    return {name: round(s, 3) for name, s in used.items()}
