"""Followers' XREADs served by a few shared ones (producer/gateway/shared_reads.py), on a real
Redis: many streams read through a bounded pool, each read getting its own streams' entries."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import redis.asyncio
from fleet_fixtures import MODEL
from gateway_fixtures import serve_gateway

from producer.client.async_client import AsyncClient
from producer.client.client import READ_COUNT
from producer.gateway.shared_reads import SharedReads
from producer.wire.keys import Keys
from producer.wire.protocol import FIELD, FinalEntry, OutputChunk

KEYS = Keys()


def _entries(request_id: str, tokens: int) -> list[tuple[str, bytes]]:
    chunks = [OutputChunk(i, [100 + i], f"t{i}") for i in range(tokens)]
    final = FinalEntry("length", tokens, {"prompt_tokens": 1, "completion_tokens": tokens})
    return [(e.entry_id, e.encode()) for e in (*chunks, final)]


async def _write(r: redis.asyncio.Redis, ids: list[str], tokens: int) -> None:
    """Each stream's entries, a round at a time, so that the readers wait between rounds."""
    per_stream = {rid: _entries(rid, tokens) for rid in ids}
    for k in range(tokens + 1):
        pipe = r.pipeline(transaction=False)
        for rid in ids:
            entry_id, message = per_stream[rid][k]
            pipe.xadd(KEYS.output(rid), {FIELD: message}, id=entry_id)
        await pipe.execute()
        await asyncio.sleep(0.01)


def test_three_hundred_followers_read_through_a_pool_of_six_connections(redis_url):
    ids = [f"shared-{i}" for i in range(300)]
    streams_a_read: list[int] = []

    async def main():
        client = AsyncClient(redis_url, max_connections=6)
        client.shared_reads = SharedReads(client.redis, count=READ_COUNT, max_readers=2)
        client.shared_reads.on_read = streams_a_read.append
        writer = redis.asyncio.Redis.from_url(redis_url)
        try:
            reading = [asyncio.ensure_future(client.result(rid, orphan_timeout=None))
                       for rid in ids]
            await asyncio.sleep(0.05)  # every follower waits on its stream
            await _write(writer, ids, tokens=5)
            return await asyncio.wait_for(asyncio.gather(*reading), timeout=120)
        finally:
            await client.shared_reads.close()
            await client.close()
            await writer.aclose()

    done = asyncio.run(main())
    assert [c.token_ids for c in done] == [[100, 101, 102, 103, 104]] * len(ids)
    assert all(c.text == "t0t1t2t3t4" and c.finish_reason == "length" for c in done)
    assert max(streams_a_read) > 100  # one XREAD named many followers' streams


def test_each_read_gets_its_own_entries_and_none_once_its_block_is_over(redis_url):
    key = KEYS.output("one-stream")

    async def main():
        r = redis.asyncio.Redis.from_url(redis_url)
        reads = SharedReads(r, count=READ_COUNT, max_readers=1)
        try:
            assert await reads.xread({KEYS.output("nobody"): "0-0"}, 30) is None
            # Two readers of one stream, from different ids, in one shared XREAD.
            early = asyncio.ensure_future(reads.xread({key: "0-0"}, 5000))
            late = asyncio.ensure_future(reads.xread({key: "2-0"}, 5000))
            gone = asyncio.ensure_future(reads.xread({key: "0-0"}, 5000))
            await asyncio.sleep(0.05)
            gone.cancel()  # a caller that gives up leaves the others served
            for i in (1, 2, 3):
                await r.xadd(key, {FIELD: b"x"}, id=f"{i}-0")
            (stream_a, got_a), = await early
            (stream_b, got_b), = await late
            return stream_a, [e[0] for e in got_a], [e[0] for e in got_b], gone.cancelled()
        finally:
            await reads.close()
            await r.aclose()

    stream, early_ids, late_ids, cancelled = asyncio.run(main())
    assert stream == key.encode() and cancelled
    assert early_ids[0] == b"1-0" and late_ids == [b"3-0"]  # each after its own id


def test_more_waiting_reads_than_readers_take_turns_and_close_ends_them_all(redis_url):
    """Past max_readers x max_keys streams, reads that got nothing go to the back of the
    queue: a read whose stream has an entry is answered while idle ones still wait."""
    ready = KEYS.output("ready")

    async def main():
        r = redis.asyncio.Redis.from_url(redis_url)
        reads = SharedReads(r, count=READ_COUNT, max_readers=1, max_keys=2)
        try:
            idle = [asyncio.ensure_future(reads.xread({KEYS.output(f"idle-{i}"): "0-0"}, 5000))
                    for i in range(2)]
            await asyncio.sleep(0.05)  # the two idle reads fill the one reader
            await r.xadd(ready, {FIELD: b"x"}, id="1-0")
            answered = await asyncio.wait_for(reads.xread({ready: "0-0"}, 5000), 30)
            still_waiting = not any(f.done() for f in idle)
        finally:
            await reads.close()
            await r.aclose()
        ended = [f.cancelled() for f in idle]
        with pytest.raises(RuntimeError, match="closed"):
            await reads.xread({ready: "0-0"}, 10)
        return answered, still_waiting, ended

    answered, still_waiting, ended = asyncio.run(main())
    assert answered[0][0] == ready.encode() and still_waiting
    assert ended == [True, True]  # close() ends the queued reads too


def test_a_failed_shared_read_fails_each_read_it_served():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        r = redis.asyncio.Redis(host="127.0.0.1", port=port)
        reads = SharedReads(r, count=READ_COUNT)
        try:
            return await asyncio.gather(reads.xread({"a": "0-0"}, 1000),
                                        reads.xread({"b": "0-0"}, 1000),
                                        return_exceptions=True)
        finally:
            await r.aclose()

    results = asyncio.run(main())
    assert all(isinstance(r, redis.exceptions.ConnectionError) for r in results)


@pytest.mark.parametrize("bad", [{"max_readers": 0}, {"max_keys": -1}, {"block_cap_ms": 0}])
def test_shared_read_settings_are_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SharedReads(None, count=1, **bad)


def test_the_gateway_streams_more_answers_at_once_than_a_connection_each_would_allow(
        redis_url, start_worker):
    """150 streamed answers at once through a gateway of 20 Redis connections: each used to
    hold one for its blocking read (and redis-py's pool refused the 101st)."""
    start_worker(simulate_step_ms=1, max_num_seqs=64)
    with serve_gateway(redis_url, redis_connections=20, read_connections=4) as gateway:

        async def one(http: httpx.AsyncClient, i: int) -> tuple[int, list[str]]:
            body = {"model": MODEL, "prompt": [5, 6, 7, i % 50], "max_tokens": 12,
                    "stream": True, "seed": i}
            async with http.stream("POST", f"{gateway.api}/completions", json=body) as resp:
                lines = [line async for line in resp.aiter_lines() if line.startswith("data:")]
            return resp.status_code, lines

        async def main():
            limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
            async with httpx.AsyncClient(timeout=120, limits=limits) as http:
                return await asyncio.gather(*(one(http, i) for i in range(150)))

        answers = asyncio.run(main())
    assert all(status == 200 for status, _ in answers)
    assert all(lines[-1] == "data: [DONE]" for _, lines in answers)
    assert all(not any('"error"' in line for line in lines) for _, lines in answers)
