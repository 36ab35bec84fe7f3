"""Backpressure, trimming and queue lag, on the embedded Redis 6.2 and on a Redis 7.

Redis 6.2 has no consumer-group lag: the max_queue script and the lane depths count
undelivered entries themselves, so both versions are exercised.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis
from redis_fixtures import REDIS_VERSIONS, redis_binary

from producer.client.async_client import AsyncClient
from producer.client.backpressure import QueueFull
from producer.client.client import Client
from producer.client.connection import connect
from producer.client.queues import lane_stats, trim_request_stream, waiting
from producer.redis.functions import install_functions
from producer.redis.server import start_ephemeral
from producer.wire.keys import GROUP, Keys

MODEL = "m"
KEYS = Keys()
STREAM = KEYS.requests(MODEL, "interactive")


@pytest.fixture(scope="module", params=REDIS_VERSIONS)
def server(request, tmp_path_factory):
    binary = redis_binary(request.param)
    with start_ephemeral(tmp_path_factory.mktemp(f"redis-{request.param}"),
                         binary=binary) as srv:
        yield srv


@pytest.fixture
def r(server):
    """The administrator; on Redis 7 with conveyor's functions loaded, so that producers
    count through FCALL there (as after `conveyor redis setup`), and through the script on 6.2."""
    client = connect(server.url)
    client.flushall()
    install_functions(client)
    client.config_resetstat()
    yield client
    client.close()


@pytest.fixture
def client(server, r):
    with Client(server.url) as c:
        yield c


def submit(client: Client, n: int = 1, **kwargs) -> list[str]:
    # No worker registers MODEL here: the queue alone is under test.
    return [client.submit([1, 2, 3], model=MODEL, max_tokens=2, allow_unregistered=True,
                          **kwargs) for _ in range(n)]


def deliver(r: redis.Redis, count: int) -> list[str]:
    """Read ``count`` entries as a worker would; their ids, oldest first."""
    reply = r.xreadgroup(GROUP, "w1", {STREAM: ">"}, count=count)
    return [entry_id.decode() for _s, entries in reply for entry_id, _f in entries]


def make_group(r: redis.Redis) -> None:
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)


def test_a_stream_no_worker_read_yet_counts_every_entry(client, r):
    submit(client, 3, max_queue=3)

    with pytest.raises(QueueFull) as refused:
        submit(client, max_queue=3)

    assert r.xlen(STREAM) == 3
    assert (refused.value.stream, refused.value.count, refused.value.limit) == (STREAM, 3, 3)
    message = str(refused.value)
    assert STREAM in message and "3 requests" in message and "max_queue is 3" in message


def test_undelivered_plus_pending_counts_and_acked_entries_do_not(client, r):
    make_group(r)
    submit(client, 5)
    delivered = deliver(r, 3)  # pending 3, undelivered 2
    r.xack(STREAM, GROUP, *delivered[:2])  # pending 1, undelivered 2

    with pytest.raises(QueueFull) as refused:
        submit(client, max_queue=3)
    assert refused.value.count == 3

    r.xack(STREAM, GROUP, delivered[2])  # pending 0, undelivered 2
    submit(client, max_queue=3)
    with pytest.raises(QueueFull):
        submit(client, max_queue=3)


def test_pending_alone_can_fill_the_queue(client, r):
    make_group(r)
    submit(client, 4)
    deliver(r, 4)

    with pytest.raises(QueueFull) as refused:
        submit(client, max_queue=4)
    assert refused.value.count == 4


def test_requests_handed_on_to_decode_workers_still_count(client, r):
    # A prefill worker acknowledges a lane entry as it hands the request on: the limit
    # holds only because the lane's handoff stream counts too.
    handoff = KEYS.handoff(MODEL, "interactive")
    make_group(r)
    r.xgroup_create(handoff, GROUP, id="0", mkstream=True)
    submit(client, 3)
    taken = deliver(r, 3)
    for entry_id in taken:  # handed on: into the handoff stream, acknowledged in the lane
        r.xadd(handoff, {"m": b"x"})
        r.xack(STREAM, GROUP, entry_id)
    r.xreadgroup(GROUP, "decode", {handoff: ">"}, count=1)  # one taken by a decode worker
    assert lane_stats(r, KEYS, MODEL)[0].depth + lane_stats(r, KEYS, MODEL)[0].pending == 0

    submit(client, max_queue=4)  # 3 waiting in the handoff stream, 1 in the lane
    with pytest.raises(QueueFull) as refused:
        submit(client, max_queue=4)
    assert refused.value.count == 4 and refused.value.stream == STREAM

    r.xack(handoff, GROUP, r.xpending_range(handoff, GROUP, "-", "+", 1)[0]["message_id"])
    submit(client, max_queue=4)  # the decode worker finished one
    assert r.xlen(handoff) == 3  # nothing is ever added to the handoff stream by a producer


def test_the_client_default_applies_and_a_call_overrides_it(server, r):
    with Client(server.url, max_queue=2) as limited:
        submit(limited, 2)
        with pytest.raises(QueueFull):
            submit(limited)
        submit(limited, max_queue=3)
    assert r.xlen(STREAM) == 3


def test_racing_producers_never_overshoot_the_limit(server, r):
    make_group(r)
    added, refused = [], []

    def produce() -> None:
        with Client(server.url) as c:
            for _ in range(10):
                try:
                    added.append(submit(c, max_queue=12)[0])
                except QueueFull:
                    refused.append(1)

    threads = [threading.Thread(target=produce) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert len(added) == 12 and len(refused) == 48
    assert r.xlen(STREAM) == 12


def test_the_script_is_loaded_again_after_redis_lost_it(client, r, server):
    submit(client, max_queue=5)
    r.script_flush()  # what a restart does to the script cache
    submit(client, max_queue=5)
    server.restart()  # and a real restart (the append-only file keeps the stream)
    submit(client, max_queue=5)
    assert r.xlen(STREAM) == 3


def test_redis7_counts_through_the_function_and_62_through_the_script(client, r, server):
    submit(client, n=2, max_queue=5)
    calls = {name: int(stats["calls"]) for name, stats in r.info("commandstats").items()
             if name in ("cmdstat_fcall", "cmdstat_evalsha", "cmdstat_eval")}
    if server.binary == redis_binary("7"):
        assert calls == {"cmdstat_fcall": 2}
    else:
        assert calls.get("cmdstat_evalsha", 0) + calls.get("cmdstat_eval", 0) >= 2
        assert "cmdstat_fcall" not in calls


def test_async_client_refuses_a_full_queue_too(server, r):
    async def run() -> None:
        async with AsyncClient(server.url, max_queue=2) as ac:
            for _ in range(2):
                await ac.submit([1, 2], model=MODEL, allow_unregistered=True)
            with pytest.raises(QueueFull):
                await ac.submit([1, 2], model=MODEL, allow_unregistered=True)

    asyncio.run(run())
    assert r.xlen(STREAM) == 2


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "10"])
def test_max_queue_must_be_a_positive_integer(client, r, server, bad):
    with pytest.raises(ValueError, match="max_queue"):
        submit(client, max_queue=bad)
    with pytest.raises(ValueError, match="max_queue"):
        Client(server.url, max_queue=bad)
    assert r.dbsize() == 0


def test_pipelined_submits_are_not_checked(server, r):
    with Client(server.url, max_queue=1) as limited:
        pipe = r.pipeline(transaction=False)
        submit(limited, 3, pipeline=pipe)  # the client's default does not apply
        pipe.execute()
        with pytest.raises(ValueError, match="pipeline"):
            submit(limited, pipeline=pipe, max_queue=5)
    assert r.xlen(STREAM) == 3


# --- trimming ----------------------------------------------------------------------------


def test_trim_keeps_everything_from_the_oldest_pending_entry(client, r):
    make_group(r)
    submit(client, 6)
    ids = deliver(r, 4)
    r.xack(STREAM, GROUP, ids[0], ids[1], ids[3])  # ids[2] still pending

    assert trim_request_stream(r, STREAM) == 2
    left = [e.decode() for e, _f in r.xrange(STREAM)]
    assert left[:2] == ids[2:4] and len(left) == 4  # pending, acked after it, 2 undelivered


def test_with_nothing_pending_trim_keeps_only_undelivered_entries(client, r):
    make_group(r)
    submit(client, 5)
    ids = deliver(r, 3)
    r.xack(STREAM, GROUP, *ids)

    assert trim_request_stream(r, STREAM) == 3
    assert r.xlen(STREAM) == 2
    assert [e.decode() for e, _f in r.xrange(STREAM)] == deliver(r, 10)  # still deliverable


def test_trim_leaves_streams_without_a_group_or_without_entries_alone(client, r):
    assert trim_request_stream(r, STREAM) == 0  # no stream
    submit(client, 3)
    assert trim_request_stream(r, STREAM) == 0  # no worker read it yet
    assert r.xlen(STREAM) == 3
    make_group(r)
    assert trim_request_stream(r, STREAM) == 0  # group, nothing delivered
    assert r.xlen(STREAM) == 3


# --- queue lag ---------------------------------------------------------------------------


def test_lane_depth_and_pending_are_visible(client, r):
    submit(client, 2, lane="batch")
    before = {s.lane: s for s in lane_stats(r, KEYS, MODEL)}
    assert (before["batch"].depth, before["batch"].pending) == (2, 0)
    assert (before["interactive"].depth, before["interactive"].length) == (0, 0)

    make_group(r)
    submit(client, 5)
    ids = deliver(r, 2)
    r.xack(STREAM, GROUP, ids[0])
    trim_request_stream(r, STREAM)

    lane = next(s for s in lane_stats(r, KEYS, MODEL) if s.lane == "interactive")
    assert (lane.depth, lane.pending, lane.length) == (3, 1, 4)


def test_a_count_with_a_limit_reads_no_more_undelivered_entries_than_it_needs(client, r):
    """Where Redis tells no lag, undelivered entries are read to be counted: a prefill
    worker asking whether its handoff streams hold its limit must not read 1,000 prompts."""
    make_group(r)
    prompt = b"x" * 20_000
    ids = [r.xadd(STREAM, {"m": prompt}).decode() for _ in range(200)]
    deliver(r, 2)
    r.xdel(STREAM, ids[100])  # (Redis 7 then cannot tell the lag either)
    assert not isinstance(r.xinfo_groups(STREAM)[0].get("lag"), int)  # precondition

    def sent(count) -> tuple[int, int]:
        before = r.info("stats")["total_net_output_bytes"]
        n = count()
        return n, r.info("stats")["total_net_output_bytes"] - before

    total, read_all = sent(lambda: waiting(r, [STREAM]))
    assert total == 199 and read_all > 150 * len(prompt)  # every undelivered entry read
    total, read_some = sent(lambda: waiting(r, [STREAM], limit=10))
    assert 10 <= total < 199 and read_some < 12 * len(prompt)
    assert waiting(r, [STREAM, STREAM], limit=10) >= 10  # stops once the limit is reached
