"""A client's wait does not go on for nothing (docs/reliability.md, "Nothing waits in
silence"): a request whose model has had no live worker for the client's orphan timeout
raises NoLiveWorker, and one that nothing holds any more (a failover lost its lane entry,
and it has no output stream) raises RequestLost at once."""

from __future__ import annotations

import asyncio

import pytest
from fleet_fixtures import MODEL

from producer.client.async_client import AsyncClient
from producer.client.client import Client
from producer.client.connection import connect
from producer.client.orphans import LOOK_S, OrphanWatch, Submitted, held_from, queue_look
from producer.clock import ManualClock
from producer.wire.errors import NoLiveWorker, RequestLost
from producer.wire.keys import GROUP, Keys

KEYS = Keys()
WHERE = Submitted(MODEL, KEYS.requests(MODEL, "interactive"), "1-0")


def test_the_watch_raises_after_the_timeout_without_a_live_worker_and_at_once_when_lost():
    clock = ManualClock()
    watch = OrphanWatch("r", WHERE, 60, clock)
    assert not watch.due() and watch.block_ms() == 100  # the first look at once, nearly
    clock.advance(0.1)
    assert watch.due()
    watch.judge(live=False, held=True)
    assert not watch.due()
    clock.advance(LOOK_S)
    assert watch.due()
    clock.advance(55)
    watch.judge(live=False, held=True)
    watch.heard()  # a worker wrote: the wait starts again
    clock.advance(59)
    watch.judge(live=False, held=True)
    clock.advance(1)
    watch.judge(live=False, held=None)  # (where it is, unknown: the wait alone counts)
    clock.advance(59.9)
    watch.judge(live=True, held=True)  # a live worker: no orphan
    clock.advance(30)
    watch.judge(live=False, held=True)
    clock.advance(60)
    with pytest.raises(NoLiveWorker, match="no live worker has served model 'tiny' for 60 s"):
        watch.judge(live=False, held=True)
    with pytest.raises(RequestLost, match="is lost"):
        OrphanWatch("r", WHERE, None, clock).judge(live=True, held=False)
    forever = OrphanWatch("r", WHERE, None, clock)
    forever.judge(live=False, held=True)
    clock.advance(10**6)
    forever.judge(live=False, held=True)  # None: waits for a worker forever


def test_a_look_finds_the_request_in_its_output_its_lane_or_a_pending_list():
    denied = ValueError("NOPERM")
    nogroup = ValueError("NOGROUP No such key or consumer group")
    group = {"name": b"workers", "last-delivered-id": b"5-0"}
    # Replies in the look's order: XINFO GROUPS, XPENDING (with the entry id), EXISTS.
    assert held_from([1], None, "workers") is True  # its output stream
    assert held_from([0], None, "workers") is None  # the entry id was never known
    assert held_from([[group], [{"message_id": b"3-0"}], 0], "3-0", "workers") is True  # held
    assert held_from([[group], [], 0], "7-0", "workers") is True  # not delivered yet
    assert held_from([[], nogroup, 0], "3-0", "workers") is True  # no worker read the lane
    assert held_from([[group], [], 0], "3-0", "workers") is False  # delivered, held nowhere
    assert held_from([ValueError("ERR no such key"), nogroup, 0], "3-0", "workers") is False
    assert held_from([denied, [], 0], "3-0", "workers") is None
    assert held_from([[group], denied, 0], "3-0", "workers") is None  # cannot tell
    assert held_from([[group], [], denied], "3-0", "workers") is None


def test_a_look_reads_where_a_request_is_alike_on_each_redis(each_redis):
    """XINFO GROUPS and XPENDING answer differently across versions (6.2 has no
    entries-read or lag): the look must read them alike."""
    r = connect(each_redis.url)
    r.flushall()
    lane, output = KEYS.requests(MODEL, "batch"), KEYS.output

    def held(entry_id: str | None, request_id: str) -> bool | None:
        pipe = r.pipeline(transaction=False)
        queue_look(pipe, lane, entry_id, output(request_id))
        return held_from(pipe.execute(raise_on_error=False), entry_id, GROUP)

    first = r.xadd(lane, {"m": b"1"}).decode()
    assert held(first, "a") is True  # in its lane, which no worker read yet (no group)
    r.xgroup_create(lane, GROUP, id="0")
    assert held(first, "a") is True  # in its lane, not delivered
    r.xreadgroup(GROUP, "w", {lane: ">"}, count=1)
    assert held(first, "a") is True  # delivered, in the worker's pending list
    r.xack(lane, GROUP, first)
    assert held(first, "a") is False  # delivered and acknowledged, with no output: lost
    r.xadd(output("a"), {"m": b"1"})
    assert held(first, "a") is True  # its output stream
    assert held(None, "b") is None  # no entry id, no output: cannot tell
    r.delete(lane)
    assert held(first, "c") is False  # the lane itself is gone
    r.close()


def test_result_raises_no_live_worker_once_the_model_had_none_for_the_timeout(redis_url):
    with Client(redis_url, orphan_timeout=0.5) as client:
        rid = client.submit("hello", model=MODEL, max_tokens=2, allow_unregistered=True)
        with pytest.raises(NoLiveWorker) as raised:
            client.result(rid)
        assert not isinstance(raised.value, RequestLost)  # it waits in its lane
        assert raised.value.request_id == rid and raised.value.model == MODEL
        # None waits for a worker forever: here the caller's own timeout ends it.
        with pytest.raises(TimeoutError):
            client.result(rid, timeout=LOOK_S + 1, orphan_timeout=None)


def test_result_raises_request_lost_at_once_when_a_failover_lost_the_request(
        redis_url, redis_client):
    with Client(redis_url, orphan_timeout=None) as client:
        rid = client.submit("hello", model=MODEL, max_tokens=2, allow_unregistered=True)
        lane = KEYS.requests(MODEL, "interactive")
        assert redis_client.delete(lane) == 1  # the fault: the failover lost the lane
        assert not redis_client.exists(KEYS.output(rid))
        with pytest.raises(RequestLost, match=f"request {rid} is lost"):
            client.result(rid, timeout=60)


def test_the_async_client_raises_the_same(redis_url, redis_client):
    async def main() -> None:
        client = AsyncClient(redis_url, orphan_timeout=0.5)
        try:
            waiting = await client.submit("hello", model=MODEL, max_tokens=2,
                                          allow_unregistered=True)
            with pytest.raises(NoLiveWorker):
                await client.result(waiting)
            lost = await client.submit("bye", model=MODEL, max_tokens=2,
                                       allow_unregistered=True)
            # A worker took it, and the failover lost what said so: delivered, pending
            # nowhere, no output.
            lane = KEYS.requests(MODEL, "interactive")
            redis_client.xgroup_create(lane, GROUP, id="0")
            [(_, entries)] = redis_client.xreadgroup(GROUP, "w", {lane: ">"})
            redis_client.xack(lane, GROUP, *[entry_id for entry_id, _ in entries])
            with pytest.raises(RequestLost):
                await client.result(lost, timeout=60)
        finally:
            await client.close()

    asyncio.run(main())
