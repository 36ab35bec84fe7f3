"""Every worker thread is supervised: it survives losing Redis, says so while it does, and a
thread that fails for good brings the worker down after handing its work back.

Workers here run on a ManualClock: backoffs and intervals pass only when the test advances
it, so "the thread is retrying right now" is a state the test holds, not a race it hopes to win.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import redis
from fleet_fixtures import MODEL
from waiting import PATIENCE_S, eventually

from producer.client.client import Client
from producer.clock import ManualClock
from producer.wire.completion import FinishReason
from producer.wire.keys import GROUP, Keys
from worker.fleet.config import WorkerConfig
from worker.fleet.supervised import BACKOFF_CAP_S

KEYS = Keys()



def connections(r: redis.Redis, name: str) -> list[dict]:
    return [c for c in r.client_list() if c.get("name") == name]


def cut(thread_client: redis.Redis, admin: redis.Redis, name: str,
        gone: Path) -> tuple[str, set[str]]:
    """Kill the thread's connections on the server and make its reconnects fail (its pool
    now makes connections to a socket path that leads nowhere); returns the path to restore
    and the ids of the connections killed."""
    pool = thread_client.connection_pool
    path = pool.connection_kwargs["path"]
    killed = {conn["id"] for conn in connections(admin, name)}  # listed before anything moves
    pool.connection_kwargs["path"] = str(gone)
    pool.reset()  # connections made from now on use the dead path (dropped ones may close)
    for conn_id in killed:
        try:
            admin.client_kill_filter(_id=conn_id)
        except redis.ResponseError:  # already closed by the client as the pool let it go
            pass
    return path, killed


def restore(thread_client: redis.Redis, path: str) -> None:
    pool = thread_client.connection_pool
    pool.connection_kwargs["path"] = path
    pool.reset()


THREADS = ["intake", "publisher", "lease-keeper", "reaper", "cancel-listener", "heartbeat",
           "queue-poller"]
# A `both` worker also fetches handed-on requests' KV on a thread of its own (it uses the
# KV tier's Redis only: tests/test_tier_stalls.py).
IO_THREADS = [*THREADS, "kv-tier-reader"]


@pytest.mark.parametrize("name", THREADS)
def test_a_thread_that_loses_redis_retries_says_so_and_recovers(name, redis_url, redis_client,
                                                                start_worker, tmp_path):
    clock = ManualClock()
    worker = start_worker("wt", clock=clock, metrics_port=0)
    thread = {t.name: t for t in worker.threads}[name]
    client = Client(redis_url)
    # One request held in flight (the engine paused) gives every thread Redis work to do.
    worker.loop.pause()
    rid = client.submit([5, 6, 7], model=MODEL, max_tokens=6, temperature=0, ignore_eos=True)
    eventually(lambda: rid in worker.inflight, "the request was read")
    if name not in ("lease-keeper", "publisher"):  # they connect on their first write
        eventually(lambda: connections(redis_client, f"wt:{name}"), "the thread is connected")

    saved, killed = cut(thread.client, redis_client, f"wt:{name}", tmp_path / "gone.sock")
    # The fault took effect: the connections it had are gone.
    assert not killed & {c["id"] for c in redis_client.client_list()}
    assert killed or name in ("lease-keeper", "publisher")
    if name == "publisher":
        worker.loop.resume()  # output to write
    else:
        # Interval threads tick (the lease keeper renews every third of a lease); blocked
        # readers already failed.
        clock.advance(getattr(thread, "renew_every_s", thread.interval_s))
    eventually(lambda: thread.retrying is not None, f"{name} met the lost connection")

    # The truth, while it lasts (the clock holds the backoff): degraded, naming the thread.
    status = worker.status()
    assert status["status"] == "degraded" and status["unhealthy_threads"] == name
    if name == "heartbeat":
        # It cannot write; its hash expires (3 intervals) instead of claiming all is well.
        with pytest.raises(redis.ConnectionError):
            worker.heartbeat.beat()
    else:
        worker.heartbeat.beat()
        beat = redis_client.hgetall(KEYS.worker("wt"))
        assert beat[b"status"] == b"degraded" and beat[b"unhealthy_threads"] == name.encode()

    restore(thread.client, saved)

    def retried_and_recovered() -> bool:
        clock.advance(BACKOFF_CAP_S)  # ends the backoff under way; the retry then succeeds
        return thread.healthy

    eventually(retried_and_recovered, f"{name} recovered")
    assert thread.is_alive() and thread.transient_errors >= 1
    assert worker.status()["status"] == "serving"
    if name == "heartbeat":
        clock.advance(thread.interval_s)
        eventually(lambda: redis_client.hget(KEYS.worker("wt"), "unhealthy_threads") == b"",
                   "the heartbeat wrote again")

    worker.loop.resume()
    done = client.result(rid, timeout=60)
    assert done.finish_reason is FinishReason.LENGTH and len(done.token_ids) == 6


@pytest.mark.parametrize("broken", ["engine-loop", "lease-keeper"])
def test_a_thread_that_fails_for_good_hands_work_back_and_the_worker_exits_1(
        broken, redis_url, redis_client, start_worker, monkeypatch):
    clock = ManualClock()
    worker = start_worker("doomed", clock=clock, autostart=False)
    client = Client(redis_url)
    stop = threading.Event()
    exit_code: list[int] = []
    server = threading.Thread(target=lambda: exit_code.append(worker.serve(stop)), daemon=True)
    server.start()
    eventually(lambda: worker.state == "serving", "the worker started")
    worker.loop.pause()
    rid = client.submit([5, 6, 7], model=MODEL, max_tokens=6, temperature=0, ignore_eos=True)
    eventually(lambda: rid in worker.inflight, "the request was read")
    stream = KEYS.requests(MODEL, "interactive")
    assert redis_client.xpending(stream, GROUP)["consumers"][0]["name"] == b"doomed"

    def bug(*_args, **_kwargs):
        raise RuntimeError("a bug, not a lost connection")

    if broken == "engine-loop":
        monkeypatch.setattr(worker.engine, "step", bug)
        worker.loop.resume()
    else:
        monkeypatch.setattr(worker.leases, "renew_all", bug)

        def keeper_ticked() -> bool:
            # An interval at a time until the keeper ticks: one advance made before the
            # keeper began its wait (a loaded machine) would be one it never sees.
            clock.advance(worker.leases.interval_s)
            return worker.leases.failure is not None

        eventually(keeper_ticked, "the lease keeper ticked", poll_s=0.05)
    server.join(PATIENCE_S)
    assert exit_code == [1] and worker.failed.name == broken
    assert worker.state == "failed"
    # Handed back (idle past the lease at once), and the heartbeat hash is gone, not "serving".
    (entry,) = redis_client.xpending_range(stream, GROUP, "-", "+", 10)
    assert entry["time_since_delivered"] >= worker.config.lease_ms
    assert not redis_client.exists(KEYS.worker("doomed"))
    # Another worker claims it and serves it in full.
    start_worker("heir")
    done = client.result(rid, timeout=60)
    assert done.finish_reason is FinishReason.LENGTH and len(done.token_ids) == 6


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="no SCHED_BATCH on this OS")
@pytest.mark.parametrize("batch, publisher", [(True, False), (True, True), (False, False)])
def test_io_threads_wait_for_a_free_core_and_the_engine_loop_and_publisher_do_not(
        batch, publisher, start_worker):
    worker = start_worker("policy", metrics_port=0,
                          config={"batch_io_threads": batch, "batch_publisher": publisher})
    io_threads = [t for t in worker.threads if t is not worker.loop]
    assert {t.name for t in io_threads} == set(IO_THREADS)  # every I/O thread is looked at

    def want(t) -> int:
        # The publisher wakes between two steps, where the engine has a core to spare.
        yields = batch and (t is not worker.publisher or publisher)
        return os.SCHED_BATCH if yields else os.SCHED_OTHER

    # Each thread sets its own policy as it starts running.
    eventually(lambda: all(t.native_id is not None
                           and os.sched_getscheduler(t.native_id) == want(t)
                           for t in io_threads), "every I/O thread runs under its policy")
    assert os.sched_getscheduler(worker.loop.native_id) == os.SCHED_OTHER


def test_the_publisher_policy_can_be_set_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("CONVEYOR_BATCH_PUBLISHER", raising=False)
    assert not WorkerConfig(tmp_path).batch_publisher
    monkeypatch.setenv("CONVEYOR_BATCH_PUBLISHER", "1")
    assert WorkerConfig(tmp_path).batch_publisher


def os_name(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux /proc only")
def test_every_worker_thread_carries_its_name_in_the_os(start_worker):
    worker = start_worker("names", metrics_port=0)
    threads = worker.threads
    assert {t.name for t in threads} == {*IO_THREADS, "engine-loop"}
    # Each thread names itself as it starts running; Linux keeps 15 bytes of a name.
    eventually(lambda: all(t.native_id is not None and os_name(t.native_id) == t.name[:15]
                           for t in threads), "every worker thread named in the OS")
    assert os_name(threading.main_thread().native_id) != "engine-loop"  # only its own thread


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux /proc only")
def test_a_long_name_is_cut_to_what_linux_keeps():
    from worker.fleet.thread_names import name_this_thread

    seen: list[tuple[bool, str]] = []

    def run() -> None:
        for name in ("a-name-longer-than-fifteen", "α" * 9):  # 18 bytes, 2 a character
            seen.append((name_this_thread(name), os_name(threading.get_native_id())))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    # Cut to 15 bytes, and on a character's boundary: 7 whole characters, not 7 and a half.
    assert seen == [(True, "a-name-longer-t"), (True, "α" * 7)]
