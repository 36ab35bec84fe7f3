"""Client and AsyncClient against a real Redis: submit, stream, result, cancel, model info.

Output entries are written here the way a worker writes them: protocol classes,
entry ids derived from token indexes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import pytest
import redis
from tokenizers import Tokenizer, models, pre_tokenizers

from producer.client.async_client import AsyncClient
from producer.client.client import CANCEL_MARKER_TTL_S, FOLLOW_MANY_KEYS, Client
from producer.client.stream_events import ChunkEvent, FinalEvent
from producer.clock import ManualClock
from producer.wire.completion import FinishReason
from producer.wire.keys import Keys
from producer.wire.protocol import (
    FIELD,
    FinalEntry,
    GenerationRequest,
    OutputChunk,
    error_final,
    now_ms,
)
from worker.cli.client_verbs import add_client_parsers, resolve_model, run_client_cmd

MODEL = "tiny-llama"
KEYS = Keys()


@pytest.fixture
def client(redis_url):  # noqa: F811
    with Client(redis_url) as c:
        yield c


@pytest.fixture
def r(redis_client):  # noqa: F811
    """The test's own connection, playing the worker's side."""
    return redis_client


def write(r: redis.Redis, request_id: str, *entries: OutputChunk | FinalEntry,
          entry_id: str | None = None) -> None:
    """Append entries to a request's output stream as a worker does (id from the indexes)."""
    for entry in entries:
        r.xadd(KEYS.output(request_id), {FIELD: entry.encode()}, id=entry_id or entry.entry_id)


def write_hello(r: redis.Redis, request_id: str = "req-1") -> None:
    write(r, request_id,
          OutputChunk(0, [10, 11, 12], "Hel"),
          OutputChunk(3, [13, 14], "lo!"),
          FinalEntry("stop", 5, {"prompt_tokens": 7, "completion_tokens": 5, "cached_tokens": 4}))


def requests_on(r: redis.Redis, model: str = MODEL, lane: str = "interactive") -> list:
    return [GenerationRequest.decode(f[FIELD]) for _, f in r.xrange(KEYS.requests(model, lane))]


def xread_calls(r: redis.Redis) -> int:
    """How many XREADs the server has run (its commandstats)."""
    return r.info("commandstats").get("cmdstat_xread", {}).get("calls", 0)


def reading_again(r: redis.Redis, since: int, reads: int) -> bool:
    """Whether ``reads`` XREADs ran since the count was ``since`` and one is blocked now."""
    blocked = any(c["cmd"] == "xread" and "b" in c["flags"] for c in r.client_list())
    return blocked and xread_calls(r) >= since + reads


# XREADs a reader runs while a ManualClock stands still before the test moves it: the first,
# one whose BLOCK (the clock's time left) ran out, and the next. Timing out on wall time
# instead, a reader would stop after the second.
READS_ON_A_STILL_CLOCK = 3


def wait_until_reading_again(r: redis.Redis, since: int) -> None:
    """Return once :func:`reading_again`; fail if it does not come within 10 s."""
    for _ in range(2000):
        if reading_again(r, since, READS_ON_A_STILL_CLOCK):
            return
        time.sleep(0.005)
    raise AssertionError("the reader stopped reading")


async def until_reading_again(r: redis.Redis, since: int) -> None:
    """:func:`wait_until_reading_again` for a reader on this event loop."""
    for _ in range(2000):
        if reading_again(r, since, READS_ON_A_STILL_CLOCK):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the reader stopped reading")


class InThread:
    """Runs ``fn`` in a thread, keeping what it raised."""

    def __init__(self, fn) -> None:
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn) -> None:
        try:
            fn()
        except Exception as e:  # handed to the test, which asserts on it
            self.error = e

    def join(self) -> None:
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "the reader did not stop"


# --- submit ----------------------------------------------------------------------------------


def test_submit_text_prompt_writes_a_decodable_request(client, r):
    register(r)
    rid = client.submit("Hello there", model=MODEL, max_tokens=8, temperature=0.0, seed=3)

    assert len(rid) == 32 and rid.isalnum()
    [req] = requests_on(r)
    assert req.request_id == rid and req.model == MODEL and req.lane == "interactive"
    assert req.prompt == "Hello there" and req.prompt_token_ids is None
    assert (req.params.max_tokens, req.params.temperature, req.params.seed) == (8, 0.0, 3)
    assert req.deadline_ms is None


def test_submit_token_ids_on_the_batch_lane_with_id_priority_and_timeout(redis_url, r):
    clock = ManualClock()
    register(r)
    with Client(redis_url, clock=clock) as client:
        rid = client.submit([1, 2, 3], model=MODEL, lane="batch", request_id="doc-7_a",
                            priority=-5, timeout=30, stop=["\n"])

    assert rid == "doc-7_a"
    assert requests_on(r, lane="interactive") == []
    [req] = requests_on(r, lane="batch")
    assert req.prompt is None and req.prompt_token_ids == [1, 2, 3]
    assert req.priority == -5 and req.params.stop == ("\n",)
    # The deadline is the client's clock (unix ms) plus the timeout, exactly.
    assert req.deadline_ms == int(clock.time() * 1000) + 30_000


def test_submit_in_a_pipeline_writes_on_execute(client, r):
    register(r)
    pipe = client.redis.pipeline()
    ids = [client.submit(f"q{i}", model=MODEL, pipeline=pipe) for i in range(3)]
    assert requests_on(r) == []
    pipe.execute()
    assert [req.request_id for req in requests_on(r)] == ids


@pytest.mark.parametrize("bad", [
    {"sampling": {"temperature": -1}},
    {"sampling": {"max_tokens": 0}},
    {"sampling": {"no_such_knob": 1}},
    {"request_id": "has space"},
    {"request_id": "x" * 65},
    {"lane": "urgent"},
    {"model": "bad:model"},
    {"prompt": ""},
    {"prompt": []},
    {"prompt": [1, -2]},
    {"priority": 5000},
    {"timeout": 0},
    {"timeout": True},  # (a bool is no number of seconds)
    {"timeout": 5, "deadline_ms": now_ms() + 5000},
])
def test_invalid_submit_raises_value_error_and_writes_nothing(client, r, bad):
    args = {"prompt": "hi", "model": MODEL, **bad}
    sampling = args.pop("sampling", {})
    with pytest.raises(ValueError):
        client.submit(args.pop("prompt"), **args, **sampling)
    assert r.dbsize() == 0


# --- stream and result -----------------------------------------------------------------------


def test_stream_yields_chunks_in_order_then_the_final(client, r):
    write_hello(r)

    events = list(client.stream("req-1"))

    assert events == [
        ChunkEvent("3-0", 0, [10, 11, 12], "Hel"),
        ChunkEvent("5-0", 3, [13, 14], "lo!"),
        FinalEvent("5-1", "stop", 5,
                   {"prompt_tokens": 7, "completion_tokens": 5, "cached_tokens": 4}, None),
    ]


def test_result_assembles_the_completion(client, r):
    write_hello(r)

    done = client.result("req-1", timeout=5)

    assert done.request_id == "req-1" and done.token_ids == [10, 11, 12, 13, 14]
    assert done.text == "Hello!" and done.finish_reason is FinishReason.STOP
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (7, 5)
    assert done.usage.cached_tokens == 4 and done.error is None


def test_result_defaults_usage_it_was_not_given(client, r):
    write(r, "req-1", OutputChunk(0, [5, 6], "ab"), FinalEntry("length", 2))
    usage = client.result("req-1", timeout=5).usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (0, 2, 0)


def test_resuming_from_a_mid_entry_yields_only_the_rest(client, r):
    write_hello(r)

    events = list(client.stream("req-1", from_id="3-0"))

    assert [type(e) for e in events] == [ChunkEvent, FinalEvent]
    assert events[0].index == 3 and events[0].token_ids == [13, 14]
    assert list(client.stream("req-1", from_id="5-0"))[0].entry_id == "5-1"


def test_no_token_index_is_yielded_twice_even_when_chunks_overlap(client, r):
    write(r, "req-1", OutputChunk(0, [0, 1], "ab"), OutputChunk(2, [2, 3], "cd"))
    # A stale writer repeating tokens 2..3 and adding 4..5, accepted because 6-0 > 4-0.
    write(r, "req-1", OutputChunk(2, [2, 3, 4, 5], "cdef"))
    # Entirely seen tokens under an id Redis accepts.
    write(r, "req-1", OutputChunk(0, [0, 1, 2], "abc"), entry_id="6-5")
    write(r, "req-1", OutputChunk(5, [5, 6], "fg"), entry_id="7-0")
    write(r, "req-1", FinalEntry("stop", 7))

    events = list(client.stream("req-1"))
    done = client.result("req-1")

    indexes = [i for e in events if isinstance(e, ChunkEvent)
               for i in range(e.index, e.index + len(e.token_ids))]
    assert indexes == list(range(7))
    assert done.token_ids == [0, 1, 2, 3, 4, 5, 6]
    # Text repeated from a chunk boundary is cut exactly; mid-chunk overlaps drop their text.
    assert done.text == "abcdef"


def test_stream_waits_for_entries_written_later(client, r):
    def worker() -> None:
        time.sleep(0.2)
        write(r, "late", OutputChunk(0, [1], "x"))
        time.sleep(0.2)
        write(r, "late", FinalEntry("length", 1))

    t = threading.Thread(target=worker)
    t.start()
    done = client.result("late", timeout=5)
    t.join()
    assert done.text == "x" and done.finish_reason is FinishReason.LENGTH


def test_timeout_raises_when_no_final_arrives(redis_url, r):
    clock = ManualClock()
    write(r, "slow", OutputChunk(0, [1, 2], "hi"))
    with Client(redis_url, clock=clock) as client:
        seen: list = []

        def read_slow() -> None:
            for event in client.stream("slow", timeout=0.3):
                seen.append(event)

        since = xread_calls(r)
        reader = InThread(read_slow)
        # Precondition: with the clock standing still the reader got the chunk, then waited
        # out a whole BLOCK and read again rather than time out.
        wait_until_reading_again(r, since)
        assert [e.token_ids for e in seen] == [[1, 2]]
        assert reader.thread.is_alive() and reader.error is None
        clock.advance(0.3)
        reader.join()
        assert isinstance(reader.error, TimeoutError)
        assert [e.token_ids for e in seen] == [[1, 2]]

        since = xread_calls(r)
        waiter = InThread(lambda: client.result("nothing-here", timeout=0.1))
        wait_until_reading_again(r, since)
        assert waiter.thread.is_alive() and waiter.error is None
        clock.advance(0.1)
        waiter.join()
        assert isinstance(waiter.error, TimeoutError)
        assert "nothing-here" in str(waiter.error)


def test_follow_many_follows_every_request_and_times_out_on_the_clock(redis_url, r):
    write_hello(r, "a")
    write(r, "b", OutputChunk(0, [7], "z"), FinalEntry("length", 1))
    # More streams than one XREAD covers: the rest are read in the next rounds.
    many = [f"m{i}" for i in range(FOLLOW_MANY_KEYS + 5)]
    pipe = r.pipeline()
    for rid in many:
        pipe.xadd(KEYS.output(rid), {FIELD: FinalEntry("stop", 0).encode()}, id="0-1")
    pipe.execute()
    write(r, "pending", OutputChunk(0, [1], "x"))
    clock = ManualClock()
    with Client(redis_url, clock=clock) as client:
        got = list(client.follow_many(["a", "b", *many], timeout=5))
        events = client.follow_many(["a", "pending"], timeout=1)
        first = [next(events) for _ in range(4)]
        clock.advance(1)
        with pytest.raises(TimeoutError, match="request pending:"):
            next(events)

    assert [(rid, e.entry_id) for rid, e in got[:5]] == [
        ("a", "3-0"), ("a", "5-0"), ("a", "5-1"), ("b", "1-0"), ("b", "1-1")]
    assert [rid for rid, _ in got[5:]] == many
    assert [(rid, e.entry_id) for rid, e in first] == [
        ("a", "3-0"), ("a", "5-0"), ("a", "5-1"), ("pending", "1-0")]


def test_error_final_gives_finish_reason_error_with_the_message(client, r):
    write(r, "bad", OutputChunk(0, [1, 2], "ok"), error_final("worker exploded", 2))

    done = client.result("bad", timeout=5)

    assert done.finish_reason is FinishReason.ERROR and done.error == "worker exploded"
    assert done.token_ids == [1, 2]


def test_stream_rejects_bad_ids_before_reading(client):
    with pytest.raises(ValueError):
        client.stream("no/slashes")
    with pytest.raises(ValueError):
        client.stream("req-1", from_id="latest")


def test_a_decoding_connection_is_refused(redis_url):  # noqa: F811
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    with pytest.raises(ValueError):
        Client(connection=conn)
    conn.close()


# --- cancel ----------------------------------------------------------------------------------


def test_cancel_sets_the_marker_and_announces_it(client, r):
    pubsub = r.pubsub()
    pubsub.subscribe(KEYS.cancel_channel)
    assert pubsub.get_message(timeout=1)["type"] == "subscribe"

    client.cancel("req-9")

    message = pubsub.get_message(timeout=2)
    assert message["channel"] == KEYS.cancel_channel.encode() and message["data"] == b"req-9"
    assert r.get(KEYS.cancelled("req-9")) == b"1"
    assert 0 < r.ttl(KEYS.cancelled("req-9")) <= CANCEL_MARKER_TTL_S
    pubsub.close()


# --- model info ------------------------------------------------------------------------------


def tiny_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def register(r: redis.Redis, name: str = MODEL) -> None:
    r.hset(KEYS.model(name), mapping={
        "name": name, "max_model_len": 2048, "eos_token_ids": json.dumps([2, 7]),
        "vocab_size": 3, "tokenizer_json": tiny_tokenizer().to_str(),
        "served_by": "w-1", "updated_ms": 1700000000000,
    })
    r.sadd(KEYS.models, name)


def test_model_info_and_tokenizer_round_trip(client, r):
    assert client.model_info(MODEL) is None and client.tokenizer(MODEL) is None
    register(r)

    info = client.model_info(MODEL)

    assert info["name"] == MODEL and info["max_model_len"] == 2048
    assert info["eos_token_ids"] == [2, 7] and info["vocab_size"] == 3
    assert info["served_by"] == "w-1" and info["updated_ms"] == 1700000000000
    assert client.tokenizer(MODEL).encode("hello world").ids == [1, 2]
    assert client.models() == [MODEL]


# --- AsyncClient -----------------------------------------------------------------------------


def test_async_client_core_behaviours(redis_url, r):  # noqa: F811
    write_hello(r)
    write(r, "slow", OutputChunk(0, [1], "x"))
    register(r)
    pubsub = r.pubsub()
    pubsub.subscribe(KEYS.cancel_channel)
    pubsub.get_message(timeout=1)

    clock = ManualClock()

    async def scenario() -> dict:
        async with AsyncClient(redis_url, clock=clock) as ac:
            out: dict = {}
            out["rid"] = await ac.submit([4, 5], model=MODEL, lane="batch", max_tokens=3)
            with pytest.raises(ValueError):
                await ac.submit("hi", model=MODEL, bogus=1)
            out["events"] = [e async for e in ac.stream("req-1")]
            out["resumed"] = [e async for e in ac.stream("req-1", from_id="3-0")]
            out["result"] = await ac.result("req-1", timeout=5)
            since = xread_calls(r)
            waiting = asyncio.create_task(ac.result("slow", timeout=0.2))
            await until_reading_again(r, since)
            # Not timed out while the clock stood still; times out once it passes 0.2 s.
            assert not waiting.done()
            clock.advance(0.2)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(waiting, timeout=10)
            await ac.cancel("req-1")
            out["info"] = await ac.model_info(MODEL)
            out["tok"] = await ac.tokenizer(MODEL)
            out["models"] = await ac.models()
            return out

    out = asyncio.run(scenario())

    [req] = requests_on(r, lane="batch")
    assert req.request_id == out["rid"] and req.prompt_token_ids == [4, 5]
    assert [e.entry_id for e in out["events"]] == ["3-0", "5-0", "5-1"]
    assert [e.entry_id for e in out["resumed"]] == ["5-0", "5-1"]
    assert out["result"].text == "Hello!" and out["result"].usage.cached_tokens == 4
    assert r.get(KEYS.cancelled("req-1")) == b"1"
    assert pubsub.get_message(timeout=2)["data"] == b"req-1"
    assert out["info"]["max_model_len"] == 2048 and out["models"] == [MODEL]
    assert out["tok"].encode("world").ids == [2]
    pubsub.close()


def test_async_stream_ticks_when_quiet_for_tick_s_on_the_clients_clock(redis_url, r):  # noqa: F811
    """``stream(tick_s=...)`` yields None once that long passed on the client's clock with
    no event (a server's keep-alive), and never while the clock stands still."""
    write(r, "quiet", OutputChunk(0, [1], "x"))
    clock = ManualClock()

    async def scenario() -> list:
        async with AsyncClient(redis_url, clock=clock) as ac:
            events = ac.stream("quiet", tick_s=0.5)
            got = [await anext(events)]
            since = xread_calls(r)
            waiting = asyncio.ensure_future(anext(events))
            await until_reading_again(r, since)
            assert not waiting.done()  # reading on, and no tick while the clock stands still
            clock.advance(0.5)
            got.append(await asyncio.wait_for(waiting, timeout=10))
            write(r, "quiet", FinalEntry("length", 1))
            got.append(await asyncio.wait_for(anext(events), timeout=10))
            return got

    chunk, tick, final = asyncio.run(scenario())
    assert chunk.token_ids == [1] and tick is None and final.finish_reason == "length"


# --- CLI -------------------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="conveyor")
    add_client_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(list(argv))


def serve_one(redis_url: str, model: str = MODEL) -> threading.Thread:  # noqa: F811
    """A stand-in worker: answers the next request on the model's stream with fixed tokens."""
    def run() -> None:
        conn = redis.Redis.from_url(redis_url)
        reply = conn.xread({KEYS.requests(model, "interactive"): "0-0"}, block=5000)
        req = GenerationRequest.decode(reply[0][1][0][1][FIELD])
        write(conn, req.request_id, OutputChunk(0, [1, 2], "Hi "), OutputChunk(2, [3], "you"),
              FinalEntry("length", 3))
        conn.close()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_resolve_model_uses_the_only_registered_model(client, r):
    with pytest.raises(ValueError, match="no model"):
        resolve_model(client, None)
    register(r)
    assert resolve_model(client, None) == MODEL
    register(r, "other")
    with pytest.raises(ValueError, match="several"):
        resolve_model(client, None)
    assert resolve_model(client, "other") == "other"


def test_cli_submit_prints_the_text_and_the_id_on_stderr(redis_url, r, capsys):  # noqa: F811
    register(r)
    worker = serve_one(redis_url)
    rc = run_client_cmd(parse("submit", "hello", "--max-tokens", "3", "--redis", redis_url))
    worker.join()

    captured = capsys.readouterr()
    [req] = requests_on(r)
    assert rc == 0 and captured.out.splitlines() == ["Hi you"]
    assert f"request {req.request_id}" in captured.err and "[length, 3 tokens]" in captured.err
    # Only what was given is set: the rest keeps Client.submit's defaults.
    assert (req.params.max_tokens, req.params.temperature) == (3, 1.0)


def test_cli_submit_stream_prints_text_and_a_summary(redis_url, r, capsys):  # noqa: F811
    worker = serve_one(redis_url, "m2")
    argv = ("submit", "hello", "--model", "m2", "--stream", "--seed", "4", "--redis", redis_url,
            "--allow-unregistered")  # the stand-in worker registers nothing
    rc = run_client_cmd(parse(*argv))
    worker.join()

    captured = capsys.readouterr()
    assert rc == 0 and captured.out == "Hi you\n"
    assert "[length, 3 tokens" in captured.err


def test_cli_tail_resumes_and_reports_errors(redis_url, r, capsys):  # noqa: F811
    write(r, "req-1", OutputChunk(0, [1], "a"), OutputChunk(1, [2], "b"), error_final("oom", 2))

    rc = run_client_cmd(parse("tail", "req-1", "--from", "1-0", "--redis", redis_url))

    captured = capsys.readouterr()
    assert rc == 1 and captured.out == "b\n"
    assert "[error, 2 tokens" in captured.err and "oom" in captured.err


def test_a_wait_refuses_a_bool_as_its_timeout(client):
    """``timeout=True`` is no number of seconds (it was read as 1 s)."""
    with pytest.raises(ValueError, match="timeout must be a non-negative number"):
        client.result("req-1", timeout=True)
    with pytest.raises(ValueError, match="timeout must be a non-negative number"):
        next(client.stream("req-1", timeout=False))
