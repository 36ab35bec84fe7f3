"""The bench's CPU accounting: preemptions counted from /proc, for a real process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from worker.bench import cpu

# Waits for a line, spins for 0.3 s of its own CPU time, says so, then waits to be let go.
CHILD = ("import os, sys, time\n"
         "os.sched_setaffinity(0, {{{cpu}}})\n"
         "sys.stdin.readline()\n"
         "end = time.process_time() + 0.3\n"
         "while time.process_time() < end: pass\n"
         "print('spun', flush=True)\n"
         "sys.stdin.readline()\n")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux /proc only")
def test_a_process_sharing_its_cpu_with_a_busy_one_is_preempted():
    # Two processes that each need 0.3 s of CPU, both held to one CPU: the scheduler must
    # take the CPU from each of them many times (its slices are milliseconds), whatever
    # else the machine runs.
    code = CHILD.format(cpu=min(os.sched_getaffinity(0)))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE) for _ in range(2)]
    try:
        before = [cpu.process_preemptions(p.pid) for p in procs]
        assert all(b is not None and b >= 0 for b in before)
        for p in procs:  # both start spinning together, on the same CPU
            p.stdin.write(b"go\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout.readline() == b"spun\n"
        # Both are alive and idle now: their counts hold the spinning's preemptions.
        counts = [cpu.delta(b, cpu.process_preemptions(p.pid))
                  for p, b in zip(procs, before, strict=True)]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
    assert all(c is not None and c > 0 for c in counts), counts


def test_an_unknown_process_has_no_count():
    assert cpu.process_preemptions(2**22 + 12345) is None  # above Linux's largest pid
    assert cpu.delta(None, 3) is None and cpu.delta(2, 5) == 3 and isinstance(cpu.delta(2, 5), int)
