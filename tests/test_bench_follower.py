"""The bench's follower (worker/bench/run/follower.py) reads raw XREAD replies: against a real
Redis, over RESP2 and RESP3 connections, it yields what a Client's tracker yields for the
same streams (chunks, an overlapping chunk cut, logprobs, finals), follows requests added
while it reads, stops at a gap and refuses an entry without a message field."""

from __future__ import annotations

import pytest
import redis

from producer.client.stream_events import ChunkEvent, FinalEvent, OutputTracker, StreamGapError
from producer.clock import ManualClock
from producer.wire.keys import Keys
from producer.wire.protocol import FIELD, FinalEntry, OutputChunk, ProtocolError
from worker.bench.run import follower as follower_module
from worker.bench.run.follower import SWEEP_S, WAITING_PER_POLL, StreamFollower

KEYS = Keys()


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def reader(request, redis_url):
    client = redis.Redis.from_url(redis_url, protocol=request.param)
    yield client
    client.close()


def write(r: redis.Redis, request_id: str, *entries: OutputChunk | FinalEntry) -> None:
    for entry in entries:
        r.xadd(KEYS.output(request_id), {FIELD: entry.encode()}, id=entry.entry_id)


def drain(follower: StreamFollower) -> list:
    events = []
    while batch := follower.poll(1):
        events.extend(batch)
    return events


def test_the_follower_yields_what_a_tracker_yields(reader, redis_client):
    lp = [[-0.5, [[7, -0.5], [8, -1.5]]], [-0.25, [[9, -0.25]]]]
    write(redis_client, "a", OutputChunk(0, [1, 2], "ab"), OutputChunk(2, [3], "c"),
          FinalEntry("stop", 3, {"prompt_tokens": 4}, text="!"))
    # A resumed request's stream repeats a token: the overlap is cut, as a Client cuts it.
    write(redis_client, "b", OutputChunk(0, [5], "x"), OutputChunk(0, [5, 6], "xy"),
          OutputChunk(2, [7, 9], "zw", lp), FinalEntry("length", 4))
    follower = StreamFollower(reader, KEYS)
    follower.add("a")
    follower.add("b")
    got = drain(follower)
    assert len(follower) == 0  # both finals arrived: nothing left to follow
    for rid in ("a", "b"):
        tracker = OutputTracker()
        want = [e for eid, f in redis_client.xrange(KEYS.output(rid))
                if (e := tracker.feed(eid, f)) is not None]
        assert [e for r, e in got if r == rid] == want
    b = [e for r, e in got if r == "b"]
    assert isinstance(b[1], ChunkEvent) and (b[1].index, b[1].token_ids, b[1].text) == (1, [6], "y")
    assert b[2].logprobs is not None and b[2].logprobs[0].top == [(7, -0.5), (8, -1.5)]
    assert isinstance(b[-1], FinalEvent) and b[-1].num_tokens == 4


def test_a_request_added_while_reading_is_followed_from_its_start(reader, redis_client):
    follower = StreamFollower(reader, KEYS)
    follower.add("first")
    write(redis_client, "first", OutputChunk(0, [1], "a"))
    assert [r for r, _ in follower.poll(1)] == ["first"]
    write(redis_client, "late", OutputChunk(0, [2], "b"), FinalEntry("stop", 1))
    follower.add("late")
    write(redis_client, "first", FinalEntry("stop", 1))
    assert sorted((r, type(e).__name__) for r, e in drain(follower)) == [
        ("first", "FinalEvent"), ("late", "ChunkEvent"), ("late", "FinalEvent")]


def test_the_follower_stops_at_a_gap_and_refuses_an_entry_without_a_message(
        reader, redis_client):
    write(redis_client, "gap", OutputChunk(0, [1], "a"), OutputChunk(3, [4], "d"))
    follower = StreamFollower(reader, KEYS)
    follower.add("gap")
    with pytest.raises(StreamGapError, match="expected token index 1"):
        follower.poll(1)
    redis_client.xadd(KEYS.output("odd"), {"other": b"x"}, id="1-0")
    odd = StreamFollower(reader, KEYS)
    odd.add("odd")
    with pytest.raises(ProtocolError, match="no message field"):
        odd.poll(1)


def test_streams_with_nothing_yet_are_read_oldest_first_and_all_at_each_sweep(
        reader, redis_client):
    """The paced follower names the oldest WAITING_PER_POLL streams that have nothing yet at
    every poll and all of them once every SWEEP_S of its clock; a stream that has begun is
    named at every poll."""
    clock = ManualClock()
    follower = StreamFollower(reader, KEYS, period_s=0, clock=clock)
    rids = [f"q{i}" for i in range(WAITING_PER_POLL + 1)]
    for rid in rids:
        follower.add(rid)
    assert follower.poll(1) == []  # the first poll sweeps: nothing anywhere yet
    late = rids[-1]  # past the oldest WAITING_PER_POLL
    write(redis_client, late, OutputChunk(0, [1], "a"))
    assert follower.poll(1) == []  # not named between sweeps
    clock.advance(SWEEP_S)
    assert [(r, e.index) for r, e in follower.poll(1)] == [(late, 0)]
    write(redis_client, late, OutputChunk(1, [2], "b"))
    assert [(r, e.index) for r, e in follower.poll(1)] == [(late, 1)]  # begun: every poll
    write(redis_client, rids[0], OutputChunk(0, [3], "c"))
    assert [(r, e.index) for r, e in follower.poll(1)] == [(rids[0], 0)]  # among the oldest


def test_a_long_queue_is_swept_a_slice_at_a_time_in_turn(reader, redis_client, monkeypatch):
    """Past SWEEP_NAMES waiting streams beyond the oldest, each sweep names the next
    SWEEP_NAMES of them: every one is named within a few sweeps, none at every sweep."""
    monkeypatch.setattr(follower_module, "SWEEP_NAMES", 2)
    clock = ManualClock()
    follower = StreamFollower(reader, KEYS, period_s=0, clock=clock)
    rids = [f"s{i}" for i in range(WAITING_PER_POLL + 5)]
    for rid in rids:
        follower.add(rid)
    for rid in rids[WAITING_PER_POLL:]:
        write(redis_client, rid, OutputChunk(0, [1], "a"))
    seen = []
    for _ in range(3):  # sweeps: 2, 2, then the last 1
        seen.append(sorted(r for r, _ in follower.poll(1)))
        clock.advance(SWEEP_S)
    assert seen == [sorted(rids[WAITING_PER_POLL:][i:i + 2]) for i in (0, 2, 4)]


def test_a_stream_that_just_gave_a_chunk_is_left_alone_for_the_quiet_time(
        reader, redis_client):
    """With ``quiet_s``, a stream is not named for that long after a chunk: what it gets
    meanwhile (here its final) is read once the time is over, nothing lost."""
    clock = ManualClock()
    follower = StreamFollower(reader, KEYS, period_s=0, clock=clock, quiet_s=0.04)
    follower.add("s")
    write(redis_client, "s", OutputChunk(0, [1], "a"))
    assert [e.index for _, e in follower.poll(1)] == [0]
    write(redis_client, "s", OutputChunk(1, [2], "b"), FinalEntry("stop", 2))
    clock.advance(0.03)
    assert follower.poll(1) == []  # within the quiet time: not named
    clock.advance(0.01)
    got = follower.poll(1)
    assert [type(e).__name__ for _, e in got] == ["ChunkEvent", "FinalEvent"]
    assert len(follower) == 0


def test_a_blocking_read_ends_when_a_quiet_stream_or_the_next_sweep_is_due(
        reader, redis_client, monkeypatch):
    """A poll whose started streams are all quiet (they began in one step, as a batch does)
    names only waiting ones: its XREAD must not block past the first quiet stream's end, nor
    past the next sweep where more wait than a poll names, or their chunks come that late."""
    clock = ManualClock()
    follower = StreamFollower(reader, KEYS, period_s=0, clock=clock, quiet_s=0.0625)
    follower.add("s")
    write(redis_client, "s", OutputChunk(0, [1], "a"))
    assert [rid for rid, _ in follower.poll(1)] == ["s"]  # quiet for 62.5 ms from now
    follower.add("w")
    clock.advance(0.015625)
    assert follower._block_ms(5000, clock.monotonic()) == 47  # 46.875, rounded up
    blocks: list[int] = []
    real = follower_module.run_commands

    def spy(client, commands):
        blocks.extend(c[c.index("BLOCK") + 1] for c in commands if "BLOCK" in c)
        return real(client, commands)

    monkeypatch.setattr(follower_module, "run_commands", spy)
    assert follower.poll(5000) == [] and blocks == [47]  # the poll's XREAD uses the cap
    clock.advance(0.0625)
    assert follower._block_ms(5000, clock.monotonic()) == 1  # due already: at once
    waiting = StreamFollower(reader, KEYS, period_s=0, clock=clock)
    for i in range(WAITING_PER_POLL + 1):
        waiting.add(f"q{i}")
    assert waiting.poll(1) == []  # a sweep now; the next in SWEEP_S
    assert waiting._block_ms(5000, clock.monotonic()) == round(SWEEP_S * 1000)
    few = StreamFollower(reader, KEYS, period_s=0, clock=clock)
    few.add("only")
    assert few.poll(1) == [] and few._block_ms(5000, clock.monotonic()) == 5000
