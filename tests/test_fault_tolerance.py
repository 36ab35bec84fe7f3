"""Nothing lost: killed workers, drains, a restarted Redis and poison requests."""

from __future__ import annotations

import random
import signal
import time

import pytest
from fleet_fixtures import MODEL, settled_pending
from worker_processes import log_events, spawn_worker, stop_all, wait_ready

from producer.client.client import Client
from producer.wire.keys import GROUP, Keys
from producer.wire.protocol import FIELD, GenerationRequest, decode_output
from worker import Engine, FinishReason, SamplingParams

KEYS = Keys()
LEASE = ["--lease-ms", "1500"]


def workload(n: int, max_tokens: int, seed: int = 0) -> tuple[list[list[int]], int]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 1000) for _ in range(rng.randint(5, 40))] for _ in range(n)]
    return prompts, max_tokens


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """No-fault greedy outputs, computed once per (prompts, max_tokens)."""
    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=2048, max_num_seqs=64)
    cache: dict = {}

    def outputs(prompts, max_tokens):
        key = (tuple(map(tuple, prompts)), max_tokens)
        if key not in cache:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            cache[key] = [c.token_ids for c in engine.generate(prompts, params)]
        return cache[key]

    return outputs


def submit_all(client: Client, prompts, max_tokens) -> list[str]:
    return [client.submit(p, model=MODEL, max_tokens=max_tokens, temperature=0, ignore_eos=True)
            for p in prompts]


def stream_indexes(client: Client, rid: str) -> list[int]:
    """Every token index written to the request's output stream, in stream order."""
    out = []
    for _, fields in client.redis.xrange(KEYS.output(rid)):
        entry = decode_output(fields[FIELD])
        if hasattr(entry, "index"):
            out.extend(range(entry.index, entry.index + len(entry.token_ids)))
    return out


def assert_exact(client: Client, ids: list[str], expected: list[list[int]]) -> None:
    """Each consumer sees the no-fault tokens; the stream holds each index exactly once."""
    results = [client.result(rid, timeout=180) for rid in ids]
    for rid, result, want in zip(ids, results, expected, strict=True):
        assert result.finish_reason is FinishReason.LENGTH, result.error
        assert result.token_ids == want
        assert stream_indexes(client, rid) == list(range(len(want)))


def pending(client: Client) -> int:
    return settled_pending(client.redis)


def owned_with_tokens(client: Client, worker: str, ids: list[str]) -> int:
    """Requests the worker holds pending whose output stream already has tokens."""
    stream = KEYS.requests(MODEL, "interactive")
    mine = client.redis.xpending_range(stream, GROUP, "-", "+", 1000, consumername=worker)
    entries = {e["message_id"] for e in mine}
    held = 0
    for entry_id, fields in client.redis.xrange(stream):
        if entry_id in entries:
            rid = GenerationRequest.decode(fields[FIELD]).request_id
            held += client.redis.xlen(KEYS.output(rid)) > 0 if rid in ids else 0
    return held


def test_sigkill_a_worker_and_the_other_finishes_its_requests_exactly(
        redis_url, tiny_llama, reference, tmp_path):
    client = Client(redis_url)
    prompts, max_tokens = workload(40, 400)
    procs = [spawn_worker(tiny_llama, redis_url, name, *LEASE, "--max-num-seqs", "16",
                          log_dir=tmp_path) for name in ("victim", "survivor")]
    try:
        for name, proc in zip(("victim", "survivor"), procs, strict=True):
            wait_ready(client, name, proc)
        ids = submit_all(client, prompts, max_tokens)
        deadline = time.monotonic() + 60
        while (held := owned_with_tokens(client, "victim", ids)) < 8:
            assert time.monotonic() < deadline, "the victim never held 8 requests with tokens"
            time.sleep(0.02)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=10)
        assert held >= 8
        assert_exact(client, ids, reference(prompts, max_tokens))
        assert pending(client) == 0
    finally:
        stop_all(procs)


def test_sigterm_drains_in_flight_requests_and_exits_zero(redis_url, tiny_llama, reference,
                                                           tmp_path):
    client = Client(redis_url)
    prompts, max_tokens = workload(6, 300, seed=1)
    proc = spawn_worker(tiny_llama, redis_url, "drainer", *LEASE, log_dir=tmp_path)
    try:
        wait_ready(client, "drainer", proc)
        ids = submit_all(client, prompts, max_tokens)
        for rid in ids:
            next(client.stream(rid, timeout=30))  # all six are in flight on this worker
        # None is finished (acknowledged) yet: the drain has work to finish.
        assert len(client.redis.xpending_range(KEYS.requests(MODEL, "interactive"), GROUP,
                                               "-", "+", 100, consumername="drainer")) == 6
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for rid, want in zip(ids, reference(prompts, max_tokens), strict=True):
            assert client.result(rid, timeout=1).token_ids == want
        assert pending(client) == 0
    finally:
        stop_all([proc])


def test_a_drain_too_short_hands_the_rest_to_another_worker(redis_url, tiny_llama, reference,
                                                            tmp_path):
    client = Client(redis_url)
    prompts, max_tokens = workload(12, 900, seed=2)
    # An hour's lease never lapses during the test: only a hand-back can move the requests.
    lease = ["--lease-ms", "3600000"]
    quitter = spawn_worker(tiny_llama, redis_url, "quitter", *lease, "--drain-timeout", "0.3",
                           log_dir=tmp_path, log_level="info")
    procs = [quitter]
    try:
        wait_ready(client, "quitter", quitter)
        ids = submit_all(client, prompts, max_tokens)
        for rid in ids:
            next(client.stream(rid, timeout=30))  # every request has started on the quitter
        # Frozen mid-generation while the taker starts, whatever the machine's speed.
        quitter.send_signal(signal.SIGSTOP)
        stream = KEYS.requests(MODEL, "interactive")
        held = client.redis.xpending_range(stream, GROUP, "-", "+", 100, consumername="quitter")
        assert len(held) == len(ids)
        procs.append(spawn_worker(tiny_llama, redis_url, "taker", *lease, log_dir=tmp_path))
        wait_ready(client, "taker", procs[1])
        quitter.send_signal(signal.SIGTERM)
        quitter.send_signal(signal.SIGCONT)
        assert quitter.wait(timeout=60) == 0
        # The fault took effect: the quitter still held unfinished work and handed it back.
        (handed,) = log_events(tmp_path, "quitter", "handed back unfinished requests")
        assert handed["count"] >= 1
        assert_exact(client, ids, reference(prompts, max_tokens))
        assert pending(client) == 0
    finally:
        stop_all(procs)


def test_redis_restart_mid_run_loses_nothing(redis_server, redis_url, tiny_llama, reference,
                                             start_worker):
    client = Client(redis_url)
    prompts, max_tokens = workload(16, 300, seed=3)
    worker = start_worker("steady", max_num_seqs=32)
    ids = submit_all(client, prompts, max_tokens)
    next(client.stream(ids[-1], timeout=30))
    worker.loop.pause()  # holds all sixteen mid-generation while Redis restarts
    assert len(worker.inflight) == len(ids)
    redis_server.restart()
    worker.loop.resume()
    assert_exact(client, ids, reference(prompts, max_tokens))
    assert pending(client) == 0


def test_a_request_that_kills_every_worker_ends_in_the_dead_letter_stream(redis_url, tiny_llama,
                                                                          tmp_path):
    client = Client(redis_url)
    poison = client.submit([5, 999, 6], model=MODEL, max_tokens=4, temperature=0,
                           allow_unregistered=True)  # queued before any worker registered
    env = {"CONVEYOR_FAULT_KILL_ON_TOKEN": "999"}
    procs = []
    try:
        deaths = 0
        deadline = time.monotonic() + 150
        while not client.redis.exists(KEYS.output(poison)) or client.redis.xlen(KEYS.dead) == 0:
            assert time.monotonic() < deadline, "the poison request was never dead-lettered"
            if not procs or procs[-1].poll() is not None:
                deaths += bool(procs)
                name = f"w{len(procs)}"
                procs.append(spawn_worker(tiny_llama, redis_url, name, "--lease-ms", "800",
                                          "--max-deliveries", "2", env=env, log_dir=tmp_path))
            time.sleep(0.2)
        result = client.result(poison, timeout=30)
        assert result.finish_reason is FinishReason.ERROR and "delivered" in result.error
        assert deaths >= 2  # it really killed workers before being set aside
        # The fleet goes on serving (a worker started after the last death takes it).
        if procs[-1].poll() is not None:
            procs.append(spawn_worker(tiny_llama, redis_url, "after", env=env, log_dir=tmp_path))
        fine = client.submit([5, 6, 7], model=MODEL, max_tokens=4, temperature=0)
        assert client.result(fine, timeout=60).finish_reason is FinishReason.LENGTH
        (_, dead), = client.redis.xrange(KEYS.dead)
        assert dead[b"request_id"] == poison.encode()
        assert pending(client) == 0
    finally:
        stop_all(procs)


def test_healthy_requests_batched_with_a_poison_one_all_finish(redis_url, tiny_llama, reference,
                                                                tmp_path):
    client = Client(redis_url)
    prompts, max_tokens = workload(4, 120, seed=5)
    # Queued before any worker: the first one reads all five and runs them together.
    healthy = [client.submit(p, model=MODEL, max_tokens=max_tokens, temperature=0,
                             ignore_eos=True, allow_unregistered=True) for p in prompts]
    poison = client.submit([5, 999, 6], model=MODEL, max_tokens=4, temperature=0,
                           allow_unregistered=True)
    env = {"CONVEYOR_FAULT_KILL_ON_TOKEN": "999"}
    procs: list = []
    try:
        deaths = 0
        deadline = time.monotonic() + 240  # a bound on the whole run, never evidence
        while client.redis.xlen(KEYS.dead) == 0 or not all(
                client.redis.exists(KEYS.output(rid)) for rid in healthy):
            assert time.monotonic() < deadline, "the fleet never settled"
            if not procs or procs[-1].poll() is not None:
                deaths += bool(procs)
                procs.append(spawn_worker(tiny_llama, redis_url, f"w{len(procs)}",
                                          "--lease-ms", "800", "--max-deliveries", "2",
                                          env=env, log_dir=tmp_path))
            time.sleep(0.2)
        assert deaths >= 2  # the poison really killed workers, innocents beside it at first
        assert_exact(client, healthy, reference(prompts, max_tokens))
        result = client.result(poison, timeout=60)
        assert result.finish_reason is FinishReason.ERROR and "alone" in result.error
        assert [f[b"request_id"] for _, f in client.redis.xrange(KEYS.dead)] == [poison.encode()]
    finally:
        stop_all(procs)


def test_without_fault_injection_configured_admission_runs_no_fault_check(
        redis_url, tiny_llama, start_worker, monkeypatch):
    monkeypatch.delenv("CONVEYOR_FAULT_KILL_ON_TOKEN", raising=False)
    worker = start_worker("plain")
    assert worker.loop.on_admit is None  # no hook: admission runs nothing for faults
    client = Client(redis_url)
    # The token a configured worker dies on is only a token here.
    rid = client.submit([5, 999, 6], model=MODEL, max_tokens=4, temperature=0)
    assert client.result(rid, timeout=60).finish_reason is FinishReason.LENGTH
    assert worker.loop.is_alive()


def test_fault_injection_is_wired_in_when_configured_at_worker_start(
        tiny_llama, start_worker, monkeypatch):
    monkeypatch.setenv("CONVEYOR_FAULT_KILL_ON_TOKEN", "999")
    armed = start_worker("armed", autostart=False)
    # Read once, as the worker is built: a later change does not disarm it.
    monkeypatch.delenv("CONVEYOR_FAULT_KILL_ON_TOKEN")
    assert armed.loop.on_admit is not None
    armed.loop.on_admit([5, 6, 7])  # a prompt without the token: nothing happens
