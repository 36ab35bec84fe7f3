"""Several choices of one request (``params.n``) through a real worker: choice i is served
as a request of its own, seeded seed + i, on its own output stream (``{id}.{i}``); the
prompt's KV is computed once and shared; a cancel of the request ends every choice; a
request refused answers every choice's stream and is dead-lettered once."""

from __future__ import annotations

import msgpack
import pytest
from fleet_fixtures import MODEL

from producer.client.client import Client
from producer.wire.keys import Keys
from producer.wire.protocol import FIELD, FinalEntry, decode_output
from producer.wire.validation import choice_id

PROMPT = [(11 * i + 5) % 400 + 2 for i in range(120)]


@pytest.fixture
def client(redis_url):
    with Client(redis_url) as c:
        yield c


def test_three_choices_equal_three_requests_seeded_s_s1_s2(start_worker, client):
    worker = start_worker(block_size=16)
    params = {"max_tokens": 12, "temperature": 0.9, "ignore_eos": True}
    rid = client.submit(PROMPT, model=MODEL, n=3, seed=41, **params)
    got = client.choices(rid, 3, timeout=60)
    computed = worker.status()["prompt_tokens_computed"]
    # Choices 1 and 2 waited for choice 0's prompt blocks and share them: each computes at
    # most the prompt's last, partial block again.
    assert computed <= len(PROMPT) + 2 * 16
    singles = [client.result(client.submit(PROMPT, model=MODEL, seed=s, **params), timeout=60)
               for s in (41, 42, 43)]
    assert [c.token_ids for c in got] == [s.token_ids for s in singles]
    assert [c.text for c in got] == [s.text for s in singles]
    assert len({tuple(c.token_ids) for c in got}) == 3  # three distinct choices
    assert client.result(rid, timeout=5).token_ids == got[0].token_ids  # choice 0: the id's


def test_a_cancel_of_the_request_ends_every_choice(start_worker, client):
    start_worker()
    rid = client.submit(PROMPT, model=MODEL, n=3, max_tokens=4000, ignore_eos=True)
    stream = client.stream(choice_id(rid, 2), timeout=60)
    next(stream)  # precondition: choice 2 is being served
    client.cancel(rid)
    done = client.choices(rid, 3, timeout=60)
    assert [c.finish_reason for c in done] == ["cancelled"] * 3
    assert all(len(c.token_ids) < 4000 for c in done)


def test_a_refused_request_answers_every_choice_and_is_dead_lettered_once(start_worker,
                                                                          client, redis_client):
    worker = start_worker()
    too_long = [5] * (worker.engine.max_model_len + 1)
    rid = client.submit(too_long, model=MODEL, n=3, max_tokens=2)
    done = client.choices(rid, 3, timeout=60)
    assert [c.finish_reason for c in done] == ["error"] * 3
    assert all("leaves no room to generate" in c.error for c in done)
    assert redis_client.xlen(Keys().dead) == 1
    # Refused by the engine, after the intake let it go: the dead letter names the request
    # (not the choice refused last) and keeps the entry as it arrived, as one the intake
    # refuses does.
    (_, dead), = redis_client.xrange(Keys().dead)
    assert dead[b"request_id"] == rid.encode()
    message = msgpack.unpackb(dead[b"raw"])
    assert message["id"] == rid and message["prompt_token_ids"] == too_long
    assert int(dead[b"raw_bytes"]) == len(dead[b"raw"])


def test_n_is_checked_at_the_edge(client):
    with pytest.raises(ValueError, match="n must be <= 16"):
        client.submit("hi", model=MODEL, n=17, allow_unregistered=True)
    with pytest.raises(ValueError, match="request id must match"):
        Keys().output("abc.0")  # choice 0 is the request's own id
    assert Keys().output(choice_id("abc", 2)) == "conveyor:out:abc.2"


def test_a_killed_workers_choices_are_finished_exactly_by_another(redis_url, tiny_llama,
                                                                  tmp_path):
    """The worker serving a request's three choices is killed once each has tokens out: the
    other claims the entry, takes over each choice's stream, and finishes every choice as
    an uninterrupted run would have (each token index once); the entry is acknowledged."""
    import signal
    import time

    from fleet_fixtures import settled_pending
    from worker_processes import spawn_worker, stop_all, wait_ready

    from producer.wire.keys import GROUP
    from worker import Engine, SamplingParams

    params = {"max_tokens": 500, "temperature": 0.9, "ignore_eos": True}
    prompt = PROMPT[:40]
    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=512)
    want = [c.token_ids for c in engine.generate(
        [prompt] * 3, [SamplingParams(**params, seed=7 + i) for i in range(3)])]
    client = Client(redis_url)
    names = ("a", "b")
    procs = dict(zip(names, (spawn_worker(tiny_llama, redis_url, name, "--lease-ms", "1500",
                                          log_dir=tmp_path) for name in names), strict=True))
    try:
        for name, proc in procs.items():
            wait_ready(client, name, proc)
        rid = client.submit(prompt, model=MODEL, n=3, seed=7, **params)
        streams = [Keys().output(choice_id(rid, i)) for i in range(3)]
        deadline = time.monotonic() + 60
        while not all(client.redis.xlen(s) for s in streams):
            assert time.monotonic() < deadline, "the choices never got tokens"
            time.sleep(0.01)
        lane = Keys().requests(MODEL, "interactive")
        (held,) = client.redis.xpending_range(lane, GROUP, "-", "+", 10)
        victim = held["consumer"].decode() if isinstance(held["consumer"], bytes) \
            else held["consumer"]
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait(timeout=10)
        finished = [isinstance(decode_output(client.redis.xrevrange(s, count=1)[0][1][FIELD]),
                               FinalEntry) for s in streams]
        assert finished == [False] * 3  # precondition: killed with every choice unfinished
        got = client.choices(rid, 3, timeout=120)
        assert [c.token_ids for c in got] == want
        for s, tokens in zip(streams, want, strict=True):
            indexes = []
            for _, fields in client.redis.xrange(s):
                entry = decode_output(fields[FIELD])
                if hasattr(entry, "index"):
                    indexes += range(entry.index, entry.index + len(entry.token_ids))
            assert indexes == list(range(len(tokens)))
        assert settled_pending(client.redis) == 0
    finally:
        stop_all(list(procs.values()))


def test_a_choice_a_stop_string_ends_leaves_the_others_to_finish(start_worker, client,
                                                                 redis_client):
    """Choice 0 ends at a stop string found where the text is made; choice 1 runs on to its
    length, and the entry is acknowledged once both ended (not with choice 0)."""
    from fleet_fixtures import pending_now, settled_pending

    start_worker()
    params = {"max_tokens": 400, "temperature": 1.0, "ignore_eos": True, "seed": 5}
    free = client.choices(client.submit(PROMPT, model=MODEL, n=2, **params), 2, timeout=60)
    stop = next(free[0].text[i:i + 4] for i in range(2, 60)
                if free[0].text[i:i + 4] not in free[1].text and free[0].text[i:i + 4].strip())
    rid = client.submit(PROMPT, model=MODEL, n=2, stop=[stop], **params)
    first = client.result(rid, timeout=60)
    last = client.last_event(choice_id(rid, 1))
    assert last is None or not hasattr(last, "finish_reason")  # precondition: 1 still runs
    assert pending_now(redis_client) == 1  # ...and the entry is held
    assert first.finish_reason == "stop"
    assert first.text == free[0].text[:free[0].text.index(stop)]
    second = client.result(choice_id(rid, 1), timeout=60)
    assert second.finish_reason == "length" and second.token_ids == free[1].token_ids
    assert settled_pending(redis_client) == 0


def test_the_cancel_listener_checks_markers_by_request_for_choices(redis_url, redis_client):
    """On (re)subscribing it looks at the markers of what the worker serves: a choice id
    ("{id}.{i}") is looked up by its request's marker, not refused."""
    import threading

    from producer.clock import SYSTEM_CLOCK
    from worker.fleet.intake.cancellation import CancelListener

    Client(redis_url).cancel("req7")
    heard: list[str] = []
    got = threading.Event()
    listener = CancelListener(redis_client, Keys(), lambda rid: (heard.append(rid), got.set()),
                              "w", inflight_ids=lambda: ["req7.1", "req7.2", "other"],
                              clock=SYSTEM_CLOCK)
    listener.start()
    try:
        assert got.wait(10) and listener.failure is None
        assert heard == ["req7"]
    finally:
        listener.stop()


def test_a_malformed_request_of_n_choices_is_answered_on_every_stream(start_worker, client,
                                                                      redis_client):
    """An entry refused before it could be read as a request (here, an unknown field) still
    names its id and its n: every choice's stream gets the error, one dead letter."""
    import msgpack

    start_worker()
    message = {"v": 1, "id": "bad7", "model": MODEL, "prompt": "hi",
               "params": {"n": 3, "max_tokens": 2}, "surprise": 1}
    redis_client.xadd(Keys().requests(MODEL, "interactive"),
                      {FIELD: msgpack.packb(message, use_bin_type=True)})
    done = client.choices("bad7", 3, timeout=60)
    assert [c.finish_reason for c in done] == ["error"] * 3
    assert all("surprise" in c.error for c in done)
    assert redis_client.xlen(Keys().dead) == 1
