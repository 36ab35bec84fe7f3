"""The bench's CPU accounting: preemptions counted from /proc, for a real process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from worker.bench.run import cpu

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


# A thread named "spinner" (as a worker's threads name themselves) spins for 0.3 s of its
# own CPU time once told to, says so, and lives on until told to end; the main thread only
# waits.
NAMED_CHILD = ("import sys, threading, time\n"
               "from worker.fleet.thread_names import name_this_thread\n"
               "def spin():\n"
               "    name_this_thread('spinner')\n"
               "    print('named', flush=True)\n"
               "    sys.stdin.readline()\n"
               "    end = time.thread_time() + 0.3\n"
               "    while time.thread_time() < end: pass\n"
               "    print('spun', flush=True)\n"
               "    sys.stdin.readline()\n"
               "t = threading.Thread(target=spin)\n"
               "t.start()\n"
               "t.join()\n")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux /proc only")
def test_cpu_seconds_are_told_apart_by_thread_name():
    proc = subprocess.Popen([sys.executable, "-c", NAMED_CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"named\n"
        before = cpu.thread_cpu_s(proc.pid)
        assert before is not None and "spinner" in {name for name, _ in before.values()}
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"spun\n"
        used = cpu.threads_delta(before, cpu.thread_cpu_s(proc.pid))
    finally:
        proc.stdin.write(b"end\n")
        proc.stdin.close()
        proc.wait(timeout=60)
    assert used is not None
    assert used["spinner"] >= 0.25  # its 0.3 s, to the clock tick (10 ms)
    assert used["spinner"] > 10 * sum(v for name, v in used.items() if name != "spinner")


def test_a_thread_started_between_two_readings_counts_from_zero():
    before = {1: ("engine-loop", 2.0), 2: ("publisher", 0.5)}
    after = {1: ("engine-loop", 3.0), 2: ("publisher", 0.75), 3: ("engine-loop", 0.5)}
    # The OpenMP partner (3) carries the engine loop's name: the two are summed.
    assert cpu.threads_delta(before, after) == {"engine-loop": 1.5, "publisher": 0.25}
    assert cpu.threads_delta(None, after) is None
    assert cpu.thread_cpu_s(2**22 + 12345) is None  # above Linux's largest pid
