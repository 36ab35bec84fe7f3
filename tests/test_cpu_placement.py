"""Where a CPU worker's threads run (worker/host/cpu_placement.py): the plan for a team and a
CPU set, the engine's OpenMP team pinned one thread a CPU from inside its own region, a
worker's loop and I/O threads placed when asked (and only then), and the bench's client and
Redis moved beside the worker for a run and back after it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from fleet_fixtures import MODEL
from kernel_fixtures import needs_kernel

from producer.client.client import Client
from worker.bench.run.runner_fleet import FleetTarget, _beside_the_worker
from worker.host.cpu_placement import Placement, pin_engine_team, plan

CPUS = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="placing threads needs two CPUs")


def test_the_plan_fills_the_cpus_and_puts_io_past_the_team_or_beside_its_last_thread():
    assert plan(2, {0, 1}) == Placement((0, 1), frozenset({1}))
    assert plan(1, {4, 7}) == Placement((4,), frozenset({7}))  # one CPU to spare: I/O's
    assert plan(2, {0, 1, 2}) == Placement((0, 1), frozenset({2}))


def test_no_plan_where_there_is_nothing_to_place():
    assert plan(1, {0}) is None  # one CPU
    assert plan(3, {0, 1}) is None  # more threads than CPUs
    assert plan(2, range(8)) is None  # room to spare: left to the OS
    assert plan(0, {0, 1}) is None
    # A larger team would shrink for torch's small regions and grow back on one CPU.
    assert plan(15, range(16)) is None


def _affinities() -> dict[int, set[int]]:
    """Each thread of this process and the CPUs it may run on."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:  # ended meanwhile
            pass
    return out


@pytest.fixture
def team_of_two():
    """torch's threads at two for the test (a team of two is what gets placed)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@needs_kernel
@two_cpus
@pytest.mark.usefixtures("team_of_two")
def test_the_engine_team_is_pinned_one_thread_a_cpu():
    team = (CPUS[0], CPUS[1])
    got: dict[str, object] = {}

    def engine_loop() -> None:  # a fresh thread, as the worker's engine loop is
        got["pinned"] = pin_engine_team(Placement(team, frozenset({team[1]})))
        got["own"] = os.sched_getaffinity(0)
        got["tid"] = threading.get_native_id()
        got["threads"] = _affinities()
        torch.ones(64, 64) @ torch.ones(64, 64)  # its regions still run, on that team

    before = set(_affinities())
    thread = threading.Thread(target=engine_loop)
    thread.start()
    thread.join()
    assert got["pinned"] is True
    assert got["own"] == {team[0]}
    # The team's other thread is new and sits on the second CPU alone.
    new = {tid: cpus for tid, cpus in got["threads"].items()
           if tid not in before and tid != got["tid"]}
    assert {team[1]} in new.values()


@needs_kernel
@two_cpus
@pytest.mark.usefixtures("team_of_two")
def test_a_team_of_another_size_is_not_pinned_at_all():
    got: dict[str, object] = {}

    def engine_loop() -> None:
        got["pinned"] = pin_engine_team(Placement((CPUS[0], CPUS[1], CPUS[0]),
                                                  frozenset({CPUS[1]})))
        got["own"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=engine_loop)
    thread.start()
    thread.join()
    assert got == {"pinned": False, "own": set(CPUS)}


def _wait_for(condition, patience_s: float = 30.0) -> bool:
    deadline = time.monotonic() + patience_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@needs_kernel
@pytest.mark.skipif(plan(2) is None, reason="this machine's CPUs leave a team of 2 unplaced")
@pytest.mark.usefixtures("team_of_two")  # the engine sets torch's threads for the process
def test_a_worker_asked_to_place_pins_its_loop_and_io_threads_and_serves(redis_url,
                                                                         start_worker):
    before = set(_affinities())
    worker = start_worker(num_threads=2, config={"place_threads": True})
    placement = plan(2)
    loop, publisher = worker.loop.native_id, worker.publisher.native_id
    assert _wait_for(lambda: os.sched_getaffinity(loop) == {placement.team[0]})
    assert _wait_for(lambda: os.sched_getaffinity(publisher) == set(placement.io))
    # The loop's OpenMP partner: a thread that is no Python thread, new, on the team's last CPU.
    python_threads = {t.native_id for t in threading.enumerate()}
    partners = [tid for tid, cpus in _affinities().items()
                if tid not in before and tid not in python_threads
                and cpus == {placement.team[1]}]
    assert partners
    client = Client(redis_url)
    rid = client.submit("placed threads", model=MODEL, max_tokens=5, temperature=0)
    assert client.result(rid, timeout=60).token_ids


@needs_kernel
@two_cpus
@pytest.mark.usefixtures("team_of_two")
def test_a_worker_leaves_its_threads_to_the_os_by_default(start_worker):
    worker = start_worker(num_threads=2)
    assert not worker.config.place_threads
    assert _wait_for(lambda: worker.loop.native_id is not None)
    assert os.sched_getaffinity(worker.loop.native_id) == set(CPUS)


@two_cpus
def test_the_bench_puts_its_client_and_redis_beside_the_worker_for_the_run(redis_url):
    client = Client(redis_url)
    pid = int(client.redis.info("server")["process_id"])
    redis_threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    before = {t: os.sched_getaffinity(t) for t in [0, *redis_threads]}
    assert all(cpus == set(CPUS) for cpus in before.values())  # nothing placed yet
    io = frozenset({CPUS[-1]})
    target = FleetTarget(Path("."), redis_url, "conveyor", [], Path("."),
                         placement=Placement(tuple(CPUS), io), own_redis=True)
    with _beside_the_worker(client, target):
        assert os.sched_getaffinity(0) == set(io)
        assert all(os.sched_getaffinity(t) == set(io) for t in redis_threads)
        assert client.redis.ping()
    assert {t: os.sched_getaffinity(t) for t in before} == before
