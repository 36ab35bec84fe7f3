"""Producers, workers and token streams over a real Redis."""

from __future__ import annotations

import random
import time

import msgpack
import pytest
from fleet_fixtures import MODEL, settled_pending
from waiting import eventually

from producer.client.client import Client
from producer.clock import ManualClock
from producer.wire.keys import Keys
from producer.wire.protocol import FIELD
from worker import Engine, FinishReason, SamplingParams
from worker.fleet.config import WorkerConfig
from worker.fleet.process import Worker
from worker.fleet.publishing.publisher import Publication

KEYS = Keys()


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 1000) for _ in range(n)]


def pending(client: Client) -> int:
    return settled_pending(client.redis)


@pytest.mark.parametrize("overlapped", [False, True], ids=["plain", "overlapped-steps"])
def test_results_equal_the_offline_engine_and_requests_are_acked(redis_url, tiny_llama,
                                                                 start_worker, overlapped):
    worker = start_worker(async_scheduling=overlapped)
    assert worker.engine.async_scheduling is overlapped
    client = Client(redis_url)
    prompts = [prompt(n, seed=n) for n in (3, 40, 120)] + ["The old library"]
    ids = [client.submit(p, model=MODEL, max_tokens=12, temperature=0) for p in prompts]
    results = [client.result(i, timeout=60) for i in ids]

    offline = Engine(tiny_llama, dtype="float64", num_kv_blocks=512)
    expected = offline.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    for got, want in zip(results, expected, strict=True):
        assert got.token_ids == want.token_ids
        assert got.text == want.text
        assert got.finish_reason == want.finish_reason
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert pending(client) == 0
    assert (worker.engine.num_overlapped_steps > 0) is overlapped


def test_stream_yields_each_token_index_once_and_can_resume(redis_url, start_worker):
    start_worker()
    client = Client(redis_url)
    rid = client.submit(prompt(20), model=MODEL, max_tokens=10, temperature=0, ignore_eos=True)
    events = list(client.stream(rid, timeout=60))
    chunks, final = events[:-1], events[-1]
    indexes = [i for c in chunks for i in range(c.index, c.index + len(c.token_ids))]
    assert indexes == list(range(10))
    assert final.finish_reason == "length" and final.num_tokens == 10
    # Resume from an entry in the middle (chunks hold what came within --stream-interval-ms:
    # the first token alone, then one or more): only what came after it.
    assert len(chunks) >= 2
    k = len(chunks) // 2
    resumed = list(client.stream(rid, from_id=chunks[k - 1].entry_id, timeout=5))
    assert [c.index for c in resumed[:-1]] == [c.index for c in chunks[k:]]


def test_model_is_registered_for_producers(redis_url, start_worker):
    worker = start_worker()
    client = Client(redis_url)
    info = client.model_info(MODEL)
    assert info["max_model_len"] == worker.engine.max_model_len
    assert info["eos_token_ids"] == sorted(worker.engine.eos_token_ids)
    tok = client.tokenizer(MODEL)
    assert tok.encode("hello there").ids == worker.engine.tokenizer.encode("hello there")


def test_two_workers_share_64_queued_requests(redis_url, start_worker):
    client = Client(redis_url)
    # Queued before any worker registered the model: allowed explicitly.
    ids = [client.submit(prompt(10, seed=i), model=MODEL, max_tokens=16, temperature=0,
                         ignore_eos=True, allow_unregistered=True) for i in range(64)]
    # Both load their model first, then start together, as long-running workers would be.
    a = start_worker("a", max_num_seqs=16, autostart=False)
    b = start_worker("b", max_num_seqs=16, autostart=False)
    a.start()
    b.start()
    results = [client.result(i, timeout=120) for i in ids]
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    assert a.loop.tokens_generated > 0 and b.loop.tokens_generated > 0
    assert a.loop.tokens_generated + b.loop.tokens_generated == 64 * 16
    assert pending(client) == 0


def test_a_burst_sent_in_one_pipeline_starts_in_one_step(redis_url, start_worker):
    """Redis answers the worker's blocked read at the burst's first entry; the rest, in the
    stream by then, comes with the same read, so no step runs the first request alone."""
    worker = start_worker(autostart=False)
    events: list[str] = []
    add, step = worker.engine.add_request, worker.engine.step
    worker.engine.add_request = lambda *a, **kw: events.append("add") or add(*a, **kw)
    worker.engine.step = lambda: events.append("step") or step()
    worker.start()
    client = Client(redis_url)
    # Precondition: the intake waits in a blocking read, so the burst wakes it.
    eventually(lambda: any("b" in c["flags"] and c["cmd"] == "xreadgroup"
                           for c in client.redis.client_list()),
               "the intake blocked in XREADGROUP")
    assert not events
    pipe = client.redis.pipeline(transaction=False)
    ids = [client.submit(prompt(6, seed=i), model=MODEL, max_tokens=3, temperature=0,
                         pipeline=pipe) for i in range(12)]
    pipe.execute()
    for rid in ids:
        client.result(rid, timeout=60)
    assert events.index("step") == 12, events[:14]  # all twelve added before the first step


def test_a_steps_output_goes_to_the_publisher_as_the_next_forward_starts(redis_url,
                                                                         start_worker):
    """On CPU the engine loop holds a step's output until the next step's forward starts, so
    that the publisher's Python runs while the native step holds no GIL; the last step's
    output, with no forward after it, goes at once. (Every step's: no stream interval, so
    no tokens are held for one.)"""
    worker = start_worker(autostart=False, config={"stream_interval_ms": 0})
    assert worker.loop._hold_output  # a CPU engine, one step at a time
    state = {"in_forward": False}
    sent: list[tuple[bool, list[int]]] = []
    execute, publish = worker.engine.runner.execute, worker.publisher.publish

    def traced_execute(*args, **kwargs):
        state["in_forward"] = True
        try:
            return execute(*args, **kwargs)
        finally:
            state["in_forward"] = False

    def traced_publish(items):
        chunks = [i.chunk.index for i in items if isinstance(i, Publication) and i.chunk]
        if chunks:
            sent.append((state["in_forward"], chunks))
        publish(items)

    worker.engine.runner.execute = traced_execute
    worker.publisher.publish = traced_publish
    worker.start()
    client = Client(redis_url)
    rid = client.submit(prompt(6), model=MODEL, max_tokens=5, temperature=0, ignore_eos=True)
    assert len(client.result(rid, timeout=60).token_ids) == 5
    assert [chunks for _, chunks in sent] == [[0], [1], [2], [3], [4]]
    assert [during for during, _ in sent] == [True, True, True, True, False]


def test_interactive_lane_is_served_before_batch(redis_url, tiny_llama):
    client = Client(redis_url)
    batch = [client.submit(prompt(5, seed=i), model=MODEL, lane="batch", max_tokens=2,
                           temperature=0, allow_unregistered=True) for i in range(4)]
    interactive = [client.submit(prompt(5, seed=i), model=MODEL, max_tokens=2, temperature=0,
                                 allow_unregistered=True) for i in range(4)]
    # One request in flight at a time, so the admission order is the reading order.
    worker = Worker(WorkerConfig(model_dir=tiny_llama, served_model_name=MODEL,
                                 redis_url=redis_url, engine={"max_num_seqs": 1}, prefetch=0,
                                 read_block_ms=100))
    admitted = []
    add = worker.engine.add_request
    worker.engine.add_request = lambda *a, **kw: admitted.append(kw["request_id"]) or add(*a, **kw)
    worker.start()
    try:
        for rid in batch:
            client.result(rid, timeout=60)
    finally:
        worker.stop()
    assert admitted == interactive + batch


def test_cancel_a_running_request_and_one_not_yet_read(redis_url, start_worker):
    worker = start_worker()
    client = Client(redis_url)
    rid = client.submit(prompt(10), model=MODEL, max_tokens=1500, temperature=0, ignore_eos=True)
    stream = client.stream(rid, timeout=60)
    next(stream)  # it is running
    client.cancel(rid)
    final = [e for e in stream][-1]
    assert final.finish_reason == "cancelled" and final.num_tokens < 1500
    # Cancelled before any worker read it: answered without running.
    worker.stop()
    early = client.submit(prompt(10), model=MODEL, max_tokens=50, temperature=0)
    client.cancel(early)
    start_worker("second")
    result = client.result(early, timeout=30)
    assert result.finish_reason is FinishReason.CANCELLED and result.token_ids == []
    assert pending(client) == 0


def test_malformed_entries_are_dead_lettered_and_the_worker_keeps_serving(redis_url,
                                                                          start_worker):
    worker = start_worker()
    client = Client(redis_url)
    stream = KEYS.requests(MODEL, "interactive")
    good = {"v": 1, "model": MODEL, "prompt_token_ids": [5, 6, 7], "params": {"max_tokens": 2}}
    bad_entries = [
        {b"x": b"no message field"},
        {FIELD: b"\xc1 not msgpack"},
        {FIELD: msgpack.packb([1, 2, 3])},
        {FIELD: msgpack.packb({**good, "id": "bad id with spaces"})},
        {FIELD: msgpack.packb({**good, "id": "missing-prompt", "prompt_token_ids": None})},
        {FIELD: msgpack.packb({**good, "id": "huge-max", "params": {"max_tokens": "lots"}})},
        {FIELD: msgpack.packb({**good, "id": "unknown-param", "params": {"beam": 4}})},
        {FIELD: msgpack.packb({**good, "id": "too-long", "prompt_token_ids": [5] * 5000})},
        {FIELD: msgpack.packb({**good, "id": "out-of-vocab", "prompt_token_ids": [10**7]})},
        {FIELD: msgpack.packb({**good, "id": "wrong-model", "model": "other"})},
    ]
    for fields in bad_entries:
        client.redis.xadd(stream, fields)
    ok = client.submit([5, 6, 7], model=MODEL, max_tokens=3, temperature=0)
    assert client.result(ok, timeout=30).finish_reason is FinishReason.LENGTH

    deadline = time.monotonic() + 10
    while client.redis.xlen(KEYS.dead) < len(bad_entries) and time.monotonic() < deadline:
        time.sleep(0.05)
    dead = client.redis.xrange(KEYS.dead)
    assert len(dead) == len(bad_entries)
    assert all(fields[b"reason"] for _, fields in dead)
    for rid in ("missing-prompt", "huge-max", "unknown-param", "too-long", "out-of-vocab",
                "wrong-model"):
        result = client.result(rid, timeout=10)
        assert result.finish_reason is FinishReason.ERROR and result.error
    assert pending(client) == 0
    assert worker.loop.is_alive() and worker.intake.is_alive()


def test_heartbeat_shows_status_and_load(redis_url, start_worker):
    start_worker("hb")
    client = Client(redis_url)
    beat = client.redis.hgetall(KEYS.worker("hb"))
    assert beat[b"status"] == b"serving" and beat[b"model"] == MODEL.encode()
    assert 0 < client.redis.ttl(KEYS.worker("hb")) <= 3


def test_stop_drains_in_flight_requests(redis_url, start_worker):
    worker = start_worker()
    client = Client(redis_url)
    ids = [client.submit(prompt(8, seed=i), model=MODEL, max_tokens=400, temperature=0,
                         ignore_eos=True) for i in range(6)]
    # Every request taken (its first token out) before the stop: one still unread in its lane
    # when the worker stops reading is rightly left there for another worker.
    for rid in ids:
        next(client.stream(rid, timeout=30))
    assert len(worker.inflight) > 0  # the stop meets work in flight
    assert worker.stop(drain_timeout_s=60)
    for rid in ids:
        assert client.result(rid, timeout=1).finish_reason is FinishReason.LENGTH
    assert pending(client) == 0
    assert client.redis.exists(KEYS.worker(worker.config.worker_id)) == 0


@pytest.mark.parametrize("lane", ["interactive", "batch"])
def test_queued_before_any_worker_existed_is_served(redis_url, start_worker, lane):
    client = Client(redis_url)
    rid = client.submit([5, 6], model=MODEL, lane=lane, max_tokens=2, temperature=0,
                        allow_unregistered=True)
    start_worker()
    assert client.result(rid, timeout=30).finish_reason is FinishReason.LENGTH


def test_stop_strings_are_applied_on_the_publisher_like_the_offline_engine(redis_url, tiny_llama,
                                                                           start_worker):
    worker = start_worker()
    client = Client(redis_url)
    offline = Engine(tiny_llama, dtype="float64", num_kv_blocks=512)
    sampling = dict(max_tokens=40, temperature=0, ignore_eos=True)
    (free,) = offline.generate(["The harbour at dawn"], SamplingParams(**sampling))
    stop = free.text[6:9]
    (want,) = offline.generate(["The harbour at dawn"], SamplingParams(**sampling, stop=[stop]))

    got = client.result(client.submit("The harbour at dawn", model=MODEL, stop=[stop], **sampling),
                        timeout=30)
    assert got.finish_reason is FinishReason.STOP == want.finish_reason
    assert got.text == want.text and stop not in got.text
    assert got.token_ids == want.token_ids
    assert pending(client) == 0
    # The engine ends it as `stop` too, so the worker's metrics say stop, not cancelled.
    assert worker.inflight.wait_empty(30)
    finished = {reason: worker.metrics.registry.get_sample_value(
        "conveyor_requests_finished_total", {"model": MODEL, "finish_reason": reason})
        for reason in ("stop", "cancelled")}
    assert finished["stop"] == 1 and not finished["cancelled"]


def test_deadlines_expire_requests_before_and_during_generation(redis_url, start_worker):
    clock = ManualClock()  # the producer's and the worker's: deadlines pass when it moves
    worker = start_worker(clock=clock)
    client = Client(redis_url, clock=clock)
    # Already past its deadline when a worker reads it: expired without a token.
    late = client.submit([5, 6, 7], model=MODEL, max_tokens=5, temperature=0,
                         deadline_ms=int(clock.time() * 1000) - 1000)
    # Expires while generating: keeps the tokens it produced.
    slow = client.submit([5, 6, 7], model=MODEL, max_tokens=1500, temperature=0,
                         ignore_eos=True, timeout=1.0)
    late_result = Client(redis_url).result(late, timeout=30)
    assert late_result.finish_reason is FinishReason.EXPIRED and late_result.token_ids == []
    assert late_result.usage.prompt_tokens == 0  # nothing done for it: an empty usage
    events = Client(redis_url).stream(slow, timeout=30)
    first = next(events)  # it is generating, before its deadline
    worker.loop.pause()  # holds it mid-generation whatever the machine's speed
    assert first.token_ids and slow in worker.inflight
    clock.advance(1.0)
    worker.loop.resume()
    slow_result = Client(redis_url).result(slow, timeout=30)
    assert slow_result.finish_reason is FinishReason.EXPIRED
    assert 0 < len(slow_result.token_ids) < 1500
    assert pending(client) == 0


@pytest.mark.parametrize("max_tokens", [300, None], ids=["max_tokens", "until-full"])
def test_a_request_whose_max_tokens_exceeds_the_kv_pool_ends_as_in_the_engine(
        redis_url, tiny_llama, start_worker, max_tokens):
    """One token-limit rule (producer.wire.stopping.token_limit): a request that can never
    fit the KV pool is refused with the same message by the offline engine and by a worker
    (an error final); without max_tokens it runs until the pool is full, in both."""
    pool = dict(num_kv_blocks=4, block_size=16)  # 64 tokens: less than the model's context
    engine = Engine(tiny_llama, dtype="float64", **pool)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start_worker(**pool)
    client = Client(redis_url)
    got = client.result(client.submit([5, 6, 7], model=MODEL, max_tokens=max_tokens,
                                      temperature=0, ignore_eos=True), timeout=60)
    if max_tokens is not None:
        with pytest.raises(ValueError, match="more than the whole KV pool") as refused:
            engine.add_request([5, 6, 7], params)
        assert not engine.has_unfinished()
        assert got.finish_reason is FinishReason.ERROR and got.error == str(refused.value)
        assert got.token_ids == []
    else:
        [want] = engine.generate([[5, 6, 7]], params)
        assert want.finish_reason is FinishReason.LENGTH and len(want.token_ids) == 64 - 3
        assert (got.finish_reason, got.token_ids) == (want.finish_reason, want.token_ids)
    assert pending(client) == 0
