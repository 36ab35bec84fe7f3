"""Clients refuse output streams that lost tokens, and a temperature too small to divide by is
greedy. Output entries are written by hand, with the ids a worker would give them, to a real
Redis; every reader (Client, AsyncClient, follow_many, `conveyor tail`, `conveyor submit`, a
batch file run) must stop at the gap with StreamGapError, never glue over it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading

import msgpack
import pytest
import redis

from producer.bulk import run_batch_file
from producer.bulk.requests import RetryPolicy
from producer.client.async_client import AsyncClient
from producer.client.client import Client
from producer.client.stream_events import ChunkEvent, OutputTracker, StreamGapError
from producer.wire.keys import Keys
from producer.wire.params import MIN_TEMPERATURE, SamplingParams
from producer.wire.protocol import FIELD, FinalEntry, GenerationRequest, OutputChunk, error_final
from worker.cli.client_verbs import add_client_parsers, run_client_cmd

KEYS = Keys()


@pytest.fixture
def client(redis_url):
    with Client(redis_url) as c:
        yield c


def write(r: redis.Redis, request_id: str, *entries: OutputChunk | FinalEntry) -> None:
    """Append entries as a worker would: each entry id derived from its token indexes."""
    for entry in entries:
        r.xadd(KEYS.output(request_id), {FIELD: entry.encode()}, id=entry.entry_id)


def write_gap(r: redis.Redis, request_id: str = "gap") -> None:
    """Tokens 0..2, then tokens 5..6 (3 and 4 never written), then a final for 7 tokens."""
    write(r, request_id, OutputChunk(0, [10, 11, 12], "abc"), OutputChunk(5, [15, 16], "fg"),
          FinalEntry("length", 7))


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="conveyor")
    add_client_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(list(argv))


def entries(r: redis.Redis, request_id: str) -> list[str]:
    return [eid.decode() for eid, _ in r.xrange(KEYS.output(request_id))]


def gap_in(r: redis.Redis, request_id: str) -> StreamGapError:
    """The gap a tracker finds reading ``request_id``'s whole stream (the test's own look)."""
    tracker = OutputTracker(request_id=request_id)
    try:
        for eid, fields in r.xrange(KEYS.output(request_id)):
            tracker.feed(eid, fields)
    except StreamGapError as gap:
        return gap
    raise AssertionError(f"no gap in {request_id}")


# --- the tracker -----------------------------------------------------------------------------


def test_the_tracker_names_the_request_the_expected_index_and_the_one_found(redis_client):
    write_gap(redis_client)
    raw = redis_client.xrange(KEYS.output("gap"))
    tracker = OutputTracker(request_id="gap")

    assert tracker.feed(*raw[0]).index == 0  # precondition: the first chunk is fine
    with pytest.raises(StreamGapError) as gap:
        tracker.feed(*raw[1])

    assert (gap.value.request_id, gap.value.expected, gap.value.found) == ("gap", 3, 5)
    assert gap.value.entry_id == "7-0" and not gap.value.final
    assert str(gap.value) == ("request gap: gap in the output stream: expected token index 3, "
                              "entry 7-0 starts at 5 (token indexes 3..4 are missing)")
    assert isinstance(gap.value, ValueError)
    assert tracker.last_id == "3-0" and not tracker.done  # it did not move past the gap


def test_a_final_that_disagrees_with_the_tokens_seen_is_refused(redis_client):
    # Too many: tokens 2..3 never came. Too few: the final contradicts what was delivered.
    write(redis_client, "short", OutputChunk(0, [1, 2], "ab"), FinalEntry("stop", 4))
    write(redis_client, "long", OutputChunk(0, [1, 2, 3], "abc"))
    # A final claiming 2 tokens, under an id Redis accepts after 3-0 (a forged or buggy one).
    redis_client.xadd(KEYS.output("long"), {FIELD: error_final("boom", 2).encode()}, id="3-1")
    write(redis_client, "ok", OutputChunk(0, [1, 2], "ab"), FinalEntry("stop", 2))

    def run(rid: str) -> StreamGapError:
        tracker = OutputTracker(request_id=rid)
        with pytest.raises(StreamGapError) as gap:
            for eid, fields in redis_client.xrange(KEYS.output(rid)):
                tracker.feed(eid, fields)
        return gap.value

    short, long = run("short"), run("long")
    assert short.final and (short.expected, short.found) == (2, 4)
    assert "final entry 4-1 says 4 tokens but 2 were delivered" in str(short)
    assert "token indexes 2..3 are missing" in str(short)
    assert long.final and (long.expected, long.found) == (3, 2)
    assert "final entry 3-1 says 2 tokens but 3 were delivered" in str(long)
    tracker = OutputTracker(request_id="ok")
    events = [tracker.feed(e, f) for e, f in redis_client.xrange(KEYS.output("ok"))]
    assert tracker.done and events[-1].num_tokens == 2


# --- every client ----------------------------------------------------------------------------


def test_client_stream_yields_what_came_before_the_gap_then_raises(client, redis_client):
    write_gap(redis_client)
    seen: list = []

    with pytest.raises(StreamGapError, match="request gap: .*expected token index 3"):
        for event in client.stream("gap", timeout=5):
            seen.append(event)

    assert seen == [ChunkEvent("3-0", 0, [10, 11, 12], "abc")]


def test_client_result_raises_on_a_gap_and_on_a_bad_final(client, redis_client):
    write_gap(redis_client)
    write(redis_client, "bad-final", OutputChunk(0, [1, 2], "ab"), FinalEntry("stop", 4))
    assert entries(redis_client, "gap")[-1] == "7-1"  # precondition: the stream is finished

    with pytest.raises(StreamGapError, match="entry 7-0 starts at 5"):
        client.result("gap", timeout=5)
    with pytest.raises(StreamGapError, match="final entry 4-1 says 4 tokens but 2"):
        client.result("bad-final", timeout=5)


def test_resuming_into_a_gap_is_refused_too(client, redis_client):
    write_gap(redis_client)
    with pytest.raises(StreamGapError) as gap:
        list(client.stream("gap", from_id="3-0", timeout=5))
    assert (gap.value.expected, gap.value.found) == (3, 5)


def test_follow_many_raises_on_the_stream_with_a_gap(client, redis_client):
    write(redis_client, "fine", OutputChunk(0, [1], "a"), FinalEntry("stop", 1))
    write_gap(redis_client)
    got: list = []

    with pytest.raises(StreamGapError) as gap:
        for item in client.follow_many(["fine", "gap"], timeout=5):
            got.append(item)

    assert gap.value.request_id == "gap"
    assert [(rid, e.entry_id) for rid, e in got] == [("fine", "1-0"), ("fine", "1-1"),
                                                      ("gap", "3-0")]


def test_async_client_stream_and_result_raise_on_a_gap(redis_url, redis_client):
    write_gap(redis_client)
    write(redis_client, "bad-final", OutputChunk(0, [1, 2], "ab"), FinalEntry("stop", 4))

    async def scenario() -> tuple[list, StreamGapError, StreamGapError]:
        async with AsyncClient(redis_url) as ac:
            seen: list = []
            with pytest.raises(StreamGapError) as streamed:
                async for event in ac.stream("gap", timeout=5):
                    seen.append(event)
            with pytest.raises(StreamGapError) as result:
                await ac.result("bad-final", timeout=5)
            return seen, streamed.value, result.value

    seen, streamed, result = asyncio.run(scenario())
    assert [e.entry_id for e in seen] == ["3-0"]
    assert (streamed.request_id, streamed.expected, streamed.found) == ("gap", 3, 5)
    assert result.final and result.request_id == "bad-final"


# --- the CLI ---------------------------------------------------------------------------------


def test_conveyor_tail_prints_what_came_before_the_gap_then_the_error_and_exits_1(
        redis_url, redis_client, capsys):
    write_gap(redis_client)

    rc = run_client_cmd(parse("tail", "gap", "--redis", redis_url))

    out, err = capsys.readouterr()
    assert rc == 1
    assert out == "abc\n"  # "fg" came after the gap: never printed
    assert "conveyor tail: error: request gap: gap in the output stream" in err
    assert "expected token index 3, entry 7-0 starts at 5" in err
    assert "[length" not in err  # no summary of a final that was never reached


def test_conveyor_submit_refuses_a_gap_in_its_answer(redis_url, redis_client, capsys):
    def stand_in_worker() -> None:
        conn = redis.Redis.from_url(redis_url)
        reply = conn.xread({KEYS.requests("m", "interactive"): "0-0"}, block=10_000)
        req = GenerationRequest.decode(reply[0][1][0][1][FIELD])
        write_gap(conn, req.request_id)
        conn.close()

    worker = threading.Thread(target=stand_in_worker)
    worker.start()
    rc = run_client_cmd(parse("submit", "hi", "--model", "m", "--allow-unregistered",
                              "--wait", "30", "--redis", redis_url))
    worker.join(10)

    err = capsys.readouterr().err
    assert rc == 1 and "conveyor submit: error: request" in err
    assert "expected token index 3" in err


# --- bulk ------------------------------------------------------------------------------------


def test_a_batch_line_whose_stream_has_a_gap_is_run_again_under_a_new_id(
        client, redis_client, redis_url, tmp_path):
    # A registered model served by a stand-in worker: its first answer loses tokens 1..2.
    redis_client.hset(KEYS.model("ghost"), mapping={"name": "ghost", "max_model_len": 64})
    redis_client.sadd(KEYS.models, "ghost")
    answered: list[str] = []

    def stand_in_worker() -> None:
        conn = redis.Redis.from_url(redis_url)
        last = "0-0"
        while len(answered) < 2:
            reply = conn.xread({KEYS.requests("ghost", "batch"): last}, block=10_000)
            if not reply:
                return
            for entry_id, fields in reply[0][1]:
                last = entry_id
                rid = GenerationRequest.decode(fields[FIELD]).request_id
                if not answered:
                    write(conn, rid, OutputChunk(0, [1], "a"), OutputChunk(3, [4], "d"),
                          FinalEntry("length", 4))
                else:
                    write(conn, rid, OutputChunk(0, [1, 2, 3, 4], "abcd"),
                          FinalEntry("length", 4))
                answered.append(rid)
        conn.close()

    worker = threading.Thread(target=stand_in_worker)
    worker.start()
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"custom_id": "q", "body": {"model": "ghost", "prompt": "x",
                                                          "max_tokens": 4}}) + "\n")
    out = tmp_path / "out.jsonl"
    policy = RetryPolicy(request_timeout=30, max_attempts=3, backoff_base=0.01)
    summary = run_batch_file(client, inp, out, policy=policy)
    worker.join(10)

    [line] = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(answered) == 2  # precondition: the first try's stream had the gap
    assert gap_in(redis_client, answered[0]).found == 3
    assert summary.succeeded == 1 and line["response"]["status_code"] == 200
    assert line["response"]["request_id"] == answered[1]
    assert line["response"]["body"]["choices"][0]["text"] == "abcd"
    assert redis_client.exists(KEYS.cancelled(answered[0]))  # the bad try was cancelled


# --- temperature floor -----------------------------------------------------------------------


@pytest.mark.parametrize("tiny", [1e-320, 5e-324, 1e-300, 1e-45, MIN_TEMPERATURE / 2])
def test_a_temperature_below_the_floor_is_greedy(tiny):
    params = SamplingParams(temperature=tiny)
    assert params.temperature == 0.0 and params.greedy
    # The wire carries greedy too, and a worker decoding a raw entry gets greedy.
    assert SamplingParams.from_dict({"temperature": tiny}).greedy
    req = GenerationRequest("r1", "m", SamplingParams.from_dict({}), prompt="hi")
    m = msgpack.unpackb(req.encode(), raw=False)
    m["params"]["temperature"] = tiny
    decoded = GenerationRequest.decode(msgpack.packb(m, use_bin_type=True))
    assert decoded.params.temperature == 0.0 and decoded.params.greedy


def test_temperatures_at_the_floor_and_above_are_kept_and_negative_ones_refused():
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    assert not SamplingParams(temperature=0.7).greedy
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1e-320)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=float("nan"))


def test_the_sampler_picks_the_argmax_for_a_subnormal_temperature():
    torch = pytest.importorskip("torch")
    from worker.sampling.sampler import Sampler, SampleRequest

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    rows = [SampleRequest(SamplingParams(temperature=1e-320), seed=7, output_index=i)
            for i in range(3)]
    # Precondition: without the floor this temperature is 0 in float32, and dividing by it
    # gives NaN probabilities.
    assert torch.tensor([1e-320], dtype=torch.float32).item() == 0.0
    assert torch.softmax(logits / torch.tensor(0.0), dim=-1).isnan().any()

    tokens, _ = Sampler()(logits, rows)

    assert tokens == logits.argmax(dim=-1).tolist()
