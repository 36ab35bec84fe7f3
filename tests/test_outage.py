"""A network outage between a worker and Redis, longer than the lease, loses nothing: the
worker takes back its own lapsed entries as renewals and every request completes, exact."""

from __future__ import annotations

import pytest
from fleet_fixtures import MODEL, output_entries, settled_pending
from tcp_proxy import TcpProxy
from waiting import eventually

from producer.client.client import Client
from producer.wire.keys import GROUP, Keys
from worker import Engine, SamplingParams

KEYS = Keys()
STREAM = KEYS.requests(MODEL, "interactive")
LEASE_MS = 3000  # short, so the outage that outlasts it is short too



@pytest.fixture
def proxy(redis_server, redis_url):
    p = TcpProxy(str(redis_server.socket))
    yield p
    p.close()


def test_an_outage_longer_than_the_lease_loses_no_request(redis_url, redis_client, tiny_llama,
                                                           start_worker, proxy):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    want = [c.token_ids for c in Engine(tiny_llama, dtype="float64",
                                        num_kv_blocks=512).generate(prompts, params)]
    worker = start_worker("cut-off", url=proxy.url, config={"lease_ms": LEASE_MS})
    client = Client(redis_url)  # the test's own path to Redis, around the proxy
    ids = [client.submit(p, model=MODEL, **params.to_dict()) for p in prompts]
    for rid in ids:
        next(client.stream(rid, timeout=60))  # all four are generating on the worker
    proxy.cut()

    def lapsed() -> bool:
        pending = redis_client.xpending_range(STREAM, GROUP, "-", "+", 10)
        return len(pending) == 4 and all(
            p["consumer"] == b"cut-off" and p["time_since_delivered"] > LEASE_MS
            for p in pending)

    eventually(lapsed, "the worker's four entries idle past the lease (Redis's own clock)")
    unfinished = [rid for rid in ids if not output_entries(redis_client, rid)[1]]
    assert unfinished  # the outage really caught requests mid-generation
    proxy.restore()

    for rid, tokens in zip(ids, want, strict=True):
        assert client.result(rid, timeout=120).token_ids == tokens
        indexes, finals = output_entries(redis_client, rid)
        assert indexes == list(range(len(tokens))) and finals == 1
    assert redis_client.xlen(KEYS.dead) == 0
    assert settled_pending(redis_client) == 0
    assert worker.reaper.claimed == 0  # nothing taken from another worker: they were its own

