"""Logprobs through the fleet: a request that asks for them gets, per token, the chosen
token's log-probability and its most likely alternatives, equal to the offline engine's."""

from __future__ import annotations

import pytest
from fleet_fixtures import MODEL

from producer.client.client import Client
from worker import Engine, SamplingParams


def test_logprobs_through_a_worker_equal_the_offline_engine(redis_url, start_worker,
                                                            tiny_llama):
    start_worker()
    prompt = [5, 9, 33, 2, 17]
    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=512)
    expected = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0,
                                                        logprobs=3, ignore_eos=True))[0]
    with Client(redis_url) as client:
        got = client.result(client.submit(prompt, model=MODEL, max_tokens=6, temperature=0,
                                          logprobs=3, ignore_eos=True), timeout=60)
        events = list(client.stream(client.submit(prompt, model=MODEL, max_tokens=6,
                                                  temperature=0, logprobs=3,
                                                  ignore_eos=True), timeout=60))
        plain = client.result(client.submit(prompt, model=MODEL, max_tokens=6,
                                            temperature=0, ignore_eos=True), timeout=60)
    assert got.token_ids == expected.token_ids
    assert [lp.token_id for lp in got.logprobs] == got.token_ids
    for ours, ref in zip(got.logprobs, expected.logprobs, strict=True):
        assert ours.logprob == pytest.approx(ref.logprob, abs=1e-9)
        assert [t for t, _ in ours.top] == [t for t, _ in ref.top] and len(ours.top) == 3
    streamed = [lp for e in events[:-1] for lp in e.logprobs]
    assert [lp.token_id for lp in streamed] == got.token_ids
    assert plain.logprobs is None  # asked for none, none on the wire
