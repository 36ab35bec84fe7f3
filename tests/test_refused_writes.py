"""Redis refusing writes (maxmemory under noeviction, as a full production Redis does) loses
nothing: no request is acknowledged before its final is written, refused output is retried,
and the engine stops stepping rather than piling output up in memory."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis
from fleet_fixtures import MODEL, output_entries
from waiting import eventually

import worker.fleet.publishing.publisher as publisher_module
from producer.client.client import Client
from producer.wire.keys import GROUP, Keys
from worker import Engine, SamplingParams

KEYS = Keys()



def oom_refusals(r: redis.Redis) -> int:
    return int(r.info("errorstats").get("errorstat_OOM", {}).get("count", 0))


@pytest.fixture
def full_redis(redis_client: redis.Redis) -> Iterator[Callable[[bool], None]]:
    """full(True) makes Redis refuse every write that needs memory; full(False) ends it."""
    assert redis_client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"

    def full(on: bool) -> None:
        redis_client.config_set("maxmemory", "1" if on else "0")

    yield full
    full(False)


def test_a_refused_final_is_retried_and_its_request_acknowledged_only_once_written(
        redis_url, redis_client, tiny_llama, start_worker, full_redis):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    # Long enough that none finishes while the four first tokens are read on a loaded
    # machine (60 did once), short of the publisher's backlog limit (256 steps).
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    want = [c.token_ids for c in Engine(tiny_llama, dtype="float64",
                                        num_kv_blocks=256).generate(prompts, params)]
    worker = start_worker("oom")
    client = Client(redis_url)
    ids = [client.submit(p, model=MODEL, **params.to_dict()) for p in prompts]
    for rid in ids:
        next(client.stream(rid, timeout=60))  # all four are generating
    # Held mid-generation while Redis fills up: on a loaded machine a free-running engine
    # could finish (and acknowledge) a request in the meantime.
    worker.loop.pause()
    stream = KEYS.requests(MODEL, "interactive")
    assert all(output_entries(redis_client, rid)[1] == 0 for rid in ids)  # none finished
    assert redis_client.xpending(stream, GROUP)["pending"] == 4
    refused_before = oom_refusals(redis_client)
    full_redis(True)
    worker.loop.resume()
    # The engine finishes all four while Redis refuses their output and finals.
    eventually(lambda: len(worker.inflight) == 0, "the engine finished the four requests")
    assert worker.publisher.refused_writes > 0 and oom_refusals(redis_client) > refused_before
    sample = worker.metrics.registry.get_sample_value
    assert sample("conveyor_redis_refused_writes_total", {"model": MODEL}) > 0
    assert sample("conveyor_redis_retries_total", {"model": MODEL, "thread": "publisher"}) > 0
    assert redis_client.xpending(stream, GROUP)["pending"] == 4  # none acknowledged unwritten
    assert all(output_entries(redis_client, rid)[1] == 0 for rid in ids)  # no final got in
    full_redis(False)
    for rid, tokens in zip(ids, want, strict=True):
        done = client.result(rid, timeout=60)
        assert done.token_ids == tokens
        assert output_entries(redis_client, rid) == (list(range(len(tokens))), 1)
    eventually(lambda: redis_client.xpending(stream, GROUP)["pending"] == 0, "all acknowledged")


def test_while_writes_are_refused_the_engine_stops_instead_of_buffering(
        redis_url, redis_client, start_worker, full_redis, monkeypatch):
    monkeypatch.setattr(publisher_module, "MAX_BACKLOG_STEPS", 8)
    worker = start_worker("held")
    client = Client(redis_url)
    rid = client.submit([5, 6, 7], model=MODEL, max_tokens=1500, temperature=0, ignore_eos=True)
    next(client.stream(rid, timeout=60))
    full_redis(True)
    # Backed up behind a refusal, not only behind a publisher slower than the engine (that
    # backlog would clear at its next batch, and the engine would step again).
    eventually(lambda: worker.publisher.refused_writes > 0 and worker.publisher.backlogged,
               "output backed up behind refused writes")
    ticks = worker.loop.ticks
    eventually(lambda: worker.loop.ticks >= ticks + 2, "a step under way has ended")
    steps = worker.engine.num_steps
    ticks = worker.loop.ticks
    eventually(lambda: worker.loop.ticks >= ticks + 20, "the engine loop went round 20 times")
    assert worker.engine.num_steps == steps  # it held: no step, nothing more buffered
    assert worker.publisher._queue.qsize() <= 8 + 1
    full_redis(False)
    done = client.result(rid, timeout=120)
    assert output_entries(redis_client, rid) == (list(range(len(done.token_ids))), 1)
    assert len(done.token_ids) == 1500
