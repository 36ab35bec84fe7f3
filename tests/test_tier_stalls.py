"""A KV tier that stops answering never stalls a worker (docs/reliability.md, "A frozen KV
tier"): each round trip has the tier's own short timeout and moves at most one chunk, the
breaker then skips the tier for a while, and the tier's transfers run on threads of their
own. A frozen tier's Redis is a real redis-server stopped with SIGSTOP."""

from __future__ import annotations

import os
import random
import signal
import time
from contextlib import contextmanager

import pytest
import redis
from fleet_fixtures import MODEL
from redis_fixtures import REDIS_VERSIONS, redis_binary

from kvstore.tier import BlockLayout, TierUnavailable
from kvstore.tier.breaker import CLOSED, HALF_OPEN, OPEN, Breaker
from kvstore.tier.redis_tier import RedisKVTier
from producer.client.client import Client
from producer.client.connection import connect
from producer.redis.ephemeral import start_ephemeral
from worker import Engine, SamplingParams

LAYOUT = BlockLayout("f" * 64, "float32", 16, 2, 2, 8, 4)


class Now:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_breaker_opens_on_a_failure_probes_once_and_closes_on_an_answer():
    now = Now()
    breaker = Breaker(open_s=30, now=now)
    before = breaker.allow()  # a call let through while closed...
    assert before is not None and breaker.state == CLOSED
    breaker.failed()  # ...and another one timed out
    assert breaker.state == OPEN and breaker.allow() is None and breaker.skipped == 1
    breaker.succeeded(before)  # the first one's answer, made before: proves nothing
    assert breaker.state == OPEN
    now.t += 29.9
    assert breaker.allow() is None
    now.t += 0.1
    assert breaker.state == HALF_OPEN
    probe = breaker.allow()
    assert probe is not None
    assert breaker.allow() is None  # the others keep skipping while it runs
    breaker.failed()  # the probe got no answer: another open_s
    assert breaker.state == OPEN and breaker.opened == 2
    now.t += 30
    probe = breaker.allow()
    breaker.succeeded(probe)
    assert breaker.state == CLOSED and breaker.allow() is not None and breaker.skipped == 3
    with pytest.raises(ValueError, match="open_s"):
        Breaker(open_s=0)


def _tier_server(tmp_path, binary: str | None = None):
    """A redis-server of its own for the tier; SIGCONT'd and stopped after the test."""
    server = start_ephemeral(tmp_path / "tier", binary=binary)
    try:
        yield server
    finally:
        if server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


@pytest.fixture
def tier_redis(tmp_path):
    yield from _tier_server(tmp_path)


@pytest.fixture(params=REDIS_VERSIONS)
def each_tier_redis(request, tmp_path):
    """The same, once on each Redis version."""
    yield from _tier_server(tmp_path, redis_binary(request.param))


@contextmanager
def frozen(server):
    """The server stopped (SIGSTOP): connections open, no answer; the precondition checked."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        with connect(server.url, socket_timeout=0.2, retry_attempts=0) as probe, \
                pytest.raises(redis.TimeoutError):
            probe.ping()  # the fault takes effect: nothing answers
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def test_a_frozen_tier_costs_one_timeout_then_is_skipped_until_it_answers(each_tier_redis):
    now = Now()
    breaker = Breaker(open_s=30, now=now)
    client = connect(each_tier_redis.url, socket_timeout=0.3, connect_timeout=0.3,
                     retry_attempts=0)
    tier = RedisKVTier(client, chunk_bytes=1024, breaker=breaker)
    payload = random.Random(1).randbytes(2 * LAYOUT.bytes_per_block)
    tier.put("before", LAYOUT, payload, 2, 20)
    with frozen(each_tier_redis):
        with pytest.raises(TierUnavailable, match="did not answer"):
            tier.put("r1", LAYOUT, payload, 2, 20)
        assert breaker.state == OPEN and breaker.opened == 1
        # Turned away at once, without a round trip: every call while it is open.
        for call in (lambda: tier.put("r2", LAYOUT, payload, 2, 20),
                     lambda: tier.get("before", LAYOUT), lambda: tier.delete("before"),
                     lambda: tier.has("before")):
            with pytest.raises(TierUnavailable, match="skipped"):
                call()
        assert breaker.skipped == 4
    now.t += 30  # the tier answers again: the next call probes, and closes the breaker
    assert tier.get("before", LAYOUT)[1] == payload
    assert breaker.state == CLOSED


def test_each_round_trip_moves_at_most_one_chunk(each_tier_redis):
    client = connect(each_tier_redis.url)
    tier = RedisKVTier(client, chunk_bytes=LAYOUT.bytes_per_block)
    payload = random.Random(0).randbytes(3 * LAYOUT.bytes_per_block)
    client.config_resetstat()
    tier.put("r", LAYOUT, payload, 3, 40)
    assert tier.get("r", LAYOUT)[1] == payload
    stats = client.info("commandstats")
    # Three chunks written and read one by one; no command carries them all at once.
    assert stats["cmdstat_set"]["calls"] == 3 + 1  # the chunks, then the header
    assert stats["cmdstat_get"]["calls"] >= 3 + 1
    assert "cmdstat_mget" not in stats or stats["cmdstat_mget"]["calls"] <= 1  # the room check


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 1000) for _ in range(rng.randint(20, 200))] for _ in range(n)]


def _run(client: Client, prompts: list[list[int]], max_tokens: int) -> tuple[list, float]:
    started = time.monotonic()
    ids = [client.submit(p, model=MODEL, max_tokens=max_tokens, temperature=0,
                         ignore_eos=True) for p in prompts]
    results = [client.result(rid, timeout=120) for rid in ids]
    return results, time.monotonic() - started


def test_a_pair_whose_tier_freezes_mid_run_ends_every_request_exactly_and_in_time(
        redis_url, start_worker, tiny_llama, tier_redis):
    # Outputs long beside the prompts: what the decode side recomputes when the KV does not
    # come is a small part of each request, as in production.
    prompts, max_tokens = _prompts(12, seed=7), 48
    reference = [c.token_ids for c in Engine(tiny_llama, dtype="float64", num_kv_blocks=1200)
                 .generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                   ignore_eos=True))]
    tier = {"kv_redis_url": tier_redis.url, "kv_timeout_s": 1.0}
    prefill = start_worker(worker_id="prefill-0", config={"role": "prefill", **tier},
                           num_kv_blocks=1200, enable_prefix_caching=False)
    decode = start_worker(worker_id="decode-0", config={"role": "decode", **tier},
                          num_kv_blocks=1200, enable_prefix_caching=False)
    with Client(redis_url) as client:
        before, took = _run(client, prompts, max_tokens)
        assert [r.token_ids for r in before] == reference
        assert decode.handoffs.imported == len(prompts)  # the tier carried every KV
        with frozen(tier_redis):
            during, took_frozen = _run(client, prompts, max_tokens)
            assert [r.token_ids for r in during] == reference
            # At most one tier timeout on top of twice the undisturbed time.
            assert took_frozen <= 2 * took + tier["kv_timeout_s"], (took_frozen, took)
            assert prefill.status()["kv_tier_breaker"] == OPEN
            assert all(r.usage.kv_transferred_tokens == 0 for r in during)  # recomputed
            assert prefill.publisher.hand_on.handed_on == 2 * len(prompts)
            # Told the tier never took the KV, the decode worker did not look it up.
            assert decode.handoffs.fallbacks["missing"] == len(prompts)
            assert decode.status()["kv_tier_breaker"] == CLOSED
