"""Claiming lapsed entries: the reaper reaches them wherever they are in the pending list,
never takes what its own worker is serving, and a claimed request it cannot serve gets its
error after the tokens already published."""

from __future__ import annotations

import redis
from fleet_fixtures import MODEL
from waiting import eventually

from producer.client.client import Client
from producer.clock import ManualClock
from producer.wire.completion import FinishReason
from producer.wire.keys import GROUP, Keys
from producer.wire.params import SamplingParams
from producer.wire.protocol import FIELD, ID_GENERATION, GenerationRequest, OutputChunk

KEYS = Keys()
STREAM = KEYS.requests(MODEL, "interactive")
LEASE_MS = 30_000  # WorkerConfig's default, which start_worker keeps



def add_request(r: redis.Redis, rid: str, prompt: list[int], max_tokens: int | None) -> str:
    req = GenerationRequest(rid, MODEL, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                       ignore_eos=True),
                            prompt_token_ids=prompt)
    return r.xadd(STREAM, {FIELD: req.encode()}).decode()


def held_by(r: redis.Redis, consumer: str, count: int, lapsed: bool = False) -> list[str]:
    """Entries ``consumer`` reads now; with ``lapsed`` their idle time is set past the lease,
    as when their worker died."""
    got = r.xreadgroup(GROUP, consumer, {STREAM: ">"}, count=count)
    ids = [eid.decode() for eid, _ in got[0][1]]
    if lapsed:
        r.xclaim(STREAM, GROUP, consumer, 0, ids, idle=10 * LEASE_MS, justid=True)
    return ids


def serving_paused(start_worker, name: str, redis_url: str):
    """A worker on a manual clock holding one request of 8 tokens, its loop paused: (clock,
    worker, client, request id)."""
    clock = ManualClock()
    worker = start_worker(name, clock=clock)
    worker.loop.pause()
    client = Client(redis_url)
    rid = client.submit([5, 6, 7], model=MODEL, max_tokens=8, temperature=0, ignore_eos=True)
    eventually(lambda: rid in worker.inflight, "the request was read")
    return clock, worker, client, rid


def test_lapsed_entries_behind_hundreds_of_live_ones_are_claimed(redis_url, redis_client,
                                                                   start_worker):
    redis_client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    for i in range(400):
        add_request(redis_client, f"live-{i}", [5, 6], 2)
    held_by(redis_client, "alive", 400)
    lapsed = [f"lapsed-{i}" for i in range(5)]
    for rid in lapsed:
        add_request(redis_client, rid, [7, 8, 9], 4)
    held_by(redis_client, "gone", 5, lapsed=True)
    pending = redis_client.xpending_range(STREAM, GROUP, "-", "+", 500)
    assert [p["consumer"] for p in pending[-5:]] == [b"gone"] * 5  # behind 400 live ones
    start_worker("reaper")
    client = Client(redis_url)
    for rid in lapsed:
        assert client.result(rid, timeout=60).finish_reason is FinishReason.LENGTH
    # Once the claimed five are acknowledged, the live entries stay with their (live) owner.

    def owners() -> set[bytes]:
        return {p["consumer"] for p in redis_client.xpending_range(STREAM, GROUP, "-", "+", 500)}

    eventually(lambda: b"reaper" not in owners(), "the claimed entries acknowledged")
    assert owners() == {b"alive"}
    assert len(redis_client.xpending_range(STREAM, GROUP, "-", "+", 500)) == 400


def test_a_worker_never_claims_away_or_dead_letters_what_it_serves_itself(
        redis_url, redis_client, start_worker):
    clock, worker, client, rid = serving_paused(start_worker, "self", redis_url)
    entry = worker.inflight.get(rid)
    # As after an outage longer than the lease: its own entry idle past the lease.
    redis_client.xclaim(STREAM, GROUP, "self", 0, [entry.entry_id], idle=10 * LEASE_MS,
                        justid=True)
    (before,) = redis_client.xpending_range(STREAM, GROUP, "-", "+", 10)
    assert before["time_since_delivered"] >= LEASE_MS
    ticks = worker.reaper.ticks
    clock.advance(worker.reaper.interval_s)
    eventually(lambda: worker.reaper.ticks > ticks, "the reaper ran")
    (after,) = redis_client.xpending_range(STREAM, GROUP, "-", "+", 10)
    assert after["consumer"] == b"self" and after["times_delivered"] == 1
    assert after["time_since_delivered"] < LEASE_MS  # renewed, not handed anywhere
    assert rid in worker.inflight and redis_client.xlen(KEYS.dead) == 0
    worker.loop.resume()
    done = client.result(rid, timeout=60)
    assert done.finish_reason is FinishReason.LENGTH and len(done.token_ids) == 8


def test_a_lapsed_second_entry_of_a_request_served_here_leaves_its_stream_alone(
        redis_url, redis_client, start_worker):
    """A second entry with the id of a request this worker serves lapses and is claimed
    here: it is refused as a duplicate without taking the stream over, so the live request's
    output still lands and ends acknowledged."""
    clock, worker, client, rid = serving_paused(start_worker, "dup", redis_url)
    # The same id again, read by a worker that then died: in one transaction, so that this
    # worker's blocked read does not get it first.
    again = GenerationRequest(rid, MODEL, SamplingParams(max_tokens=8), prompt_token_ids=[5])
    pipe = redis_client.pipeline(transaction=True)
    pipe.xadd(STREAM, {FIELD: again.encode()})
    pipe.xreadgroup(GROUP, "gone", {STREAM: ">"}, count=1)
    eid, _ = pipe.execute()
    redis_client.xclaim(STREAM, GROUP, "gone", 0, [eid], idle=10 * LEASE_MS, justid=True)
    ticks = worker.reaper.ticks
    clock.advance(worker.reaper.interval_s)
    eventually(lambda: redis_client.xlen(KEYS.dead) == 1, "the duplicate dead-lettered")
    assert worker.reaper.ticks > ticks and rid in worker.inflight  # claimed while live here
    # Not taken over by it (the live request may have a first token out: the pause takes
    # effect after a step the loop may have begun).
    if redis_client.exists(KEYS.output(rid)):
        last = redis_client.xinfo_stream(KEYS.output(rid))["last-generated-id"]
        assert int(last.split(b"-")[0]) < ID_GENERATION
    worker.loop.resume()
    done = client.result(rid, timeout=60)
    assert done.finish_reason is FinishReason.LENGTH and len(done.token_ids) == 8
    assert redis_client.xrevrange(KEYS.output(rid), count=1)[0][0] == b"8-1"
    eventually(lambda: redis_client.xpending(STREAM, GROUP)["pending"] == 0, "acknowledged")


def test_a_claimed_request_rejected_gets_its_error_after_the_published_tokens(
        redis_url, redis_client, start_worker):
    rid = "resumed-too-big"
    redis_client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    add_request(redis_client, rid, list(range(5, 45)), 100)
    held_by(redis_client, "gone", 1, lapsed=True)
    # The worker that died had published three tokens.
    chunk = OutputChunk(0, [11, 12, 13], "")
    redis_client.xadd(KEYS.output(rid), {FIELD: chunk.encode()}, id=chunk.entry_id)
    # This worker's KV pool (4 blocks of 16) cannot hold 40 + 100 tokens: it must refuse.
    start_worker("small-pool", num_kv_blocks=4)
    done = Client(redis_url).result(rid, timeout=60)
    assert done.finish_reason is FinishReason.ERROR and "KV pool" in done.error
    assert done.token_ids == [11, 12, 13]
    final_id = redis_client.xrevrange(KEYS.output(rid), count=1)[0][0]
    # After the three tokens, in the ids of the stream's first take-over.
    assert final_id == f"{ID_GENERATION + 3}-1".encode()
    eventually(lambda: redis_client.xpending(STREAM, GROUP)["pending"] == 0, "acknowledged")


def test_a_claimed_request_whose_published_tokens_fill_the_kv_pool_ends_length(
        redis_url, redis_client, start_worker):
    """One token-limit rule (producer.wire.stopping.token_limit): without max_tokens a
    request generates until the KV pool is full, in the engine and on a worker that resumes
    it, so tokens already published up to there end it as ``length``, not as an error."""
    rid = "resumed-full"
    redis_client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    add_request(redis_client, rid, list(range(5, 45)), None)
    held_by(redis_client, "gone", 1, lapsed=True)
    # 40 prompt tokens and the 24 the dead worker published fill 4 blocks of 16.
    chunk = OutputChunk(0, list(range(11, 35)), "")
    redis_client.xadd(KEYS.output(rid), {FIELD: chunk.encode()}, id=chunk.entry_id)
    start_worker("small-pool", num_kv_blocks=4)
    done = Client(redis_url).result(rid, timeout=60)
    assert done.finish_reason is FinishReason.LENGTH and done.token_ids == list(range(11, 35))
    eventually(lambda: redis_client.xpending(STREAM, GROUP)["pending"] == 0, "acknowledged")


def test_a_claimed_request_found_complete_ends_complete_though_its_deadline_passed(
        redis_url, redis_client, start_worker):
    """Its tokens were all made before the deadline (the worker died before its final): it
    ends as they end it, with its usage, not as expired with an empty one."""
    clock = ManualClock()
    rid = "resumed-complete-late"
    redis_client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    req = GenerationRequest(rid, MODEL, SamplingParams(max_tokens=3, temperature=0,
                                                       ignore_eos=True),
                            prompt_token_ids=[5, 6, 7],
                            deadline_ms=int(clock.time() * 1000) + 1000)
    redis_client.xadd(STREAM, {FIELD: req.encode()})
    held_by(redis_client, "gone", 1, lapsed=True)
    chunk = OutputChunk(0, [11, 12, 13], "")  # every token max_tokens allows
    redis_client.xadd(KEYS.output(rid), {FIELD: chunk.encode()}, id=chunk.entry_id)
    clock.advance(5)  # the deadline passed while nobody held it
    start_worker("late", clock=clock)
    done = Client(redis_url).result(rid, timeout=60)
    assert done.finish_reason is FinishReason.LENGTH and done.token_ids == [11, 12, 13]
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (3, 3)


def test_a_dead_workers_consumer_leaves_the_group_only_once_it_holds_nothing(
        redis_url, redis_client, start_worker, monkeypatch):
    import worker.fleet.housekeeping.reaper as reaper_module

    # Idle for 1 s counts as dead here (10 leases in production), the lease staying 30 s.
    monkeypatch.setattr(reaper_module, "DEAD_CONSUMER_LEASES", 1000 / LEASE_MS)
    redis_client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    redis_client.execute_command("XGROUP", "CREATECONSUMER", STREAM, GROUP, "ghost")  # holds none
    add_request(redis_client, "held-by-holder", [5, 6], 2)
    held_by(redis_client, "holder", 1)  # idle too, but holds an entry (not yet lapsed)
    clock = ManualClock()
    worker = start_worker("sweeper", clock=clock)

    def idle_ms() -> dict[bytes, int]:
        return {c["name"]: int(c["idle"]) for c in redis_client.xinfo_consumers(STREAM, GROUP)}

    eventually(lambda: min(idle_ms()[n] for n in (b"ghost", b"holder")) >= 1000,
               "both consumers idle past the limit (Redis's own idle time)")
    ticks = worker.reaper.ticks
    clock.advance(worker.reaper.housekeeping_interval_s)
    eventually(lambda: worker.reaper.ticks > ticks, "the reaper swept")
    names = set(idle_ms())
    assert b"ghost" not in names and b"holder" in names  # gone, and kept: it holds an entry
    assert worker.reaper.sweeper.removed == 1


def test_hand_backs_do_not_count_as_deliveries(redis_url, redis_client, start_worker):
    # With a delivery limit of 1, a second counted delivery would dead-letter the request.
    strict = {"max_deliveries": 1}
    client = Client(redis_url)
    rid = client.submit([5, 6, 7], model=MODEL, max_tokens=40, temperature=0, ignore_eos=True,
                        allow_unregistered=True)
    for name in ("first", "second"):  # two graceful drains in a row, each holding it
        worker = start_worker(name, autostart=False, config=strict)
        worker.loop.pause()  # it holds the request without finishing it
        worker.start()
        eventually(lambda w=worker: rid in w.inflight, f"{name} took the request")
        worker.stop(drain_timeout_s=0)  # hands it back
        (entry,) = redis_client.xpending_range(STREAM, GROUP, "-", "+", 10)
        assert entry["consumer"] == name.encode() and entry["times_delivered"] == 0
    start_worker("last", config=strict)
    done = client.result(rid, timeout=60)
    assert done.finish_reason is FinishReason.LENGTH and len(done.token_ids) == 40
    assert redis_client.xlen(KEYS.dead) == 0


def test_served_entries_are_trimmed_every_housekeeping_interval_of_the_workers_clock(
        redis_url, redis_client, start_worker):
    clock = ManualClock()
    worker = start_worker("trimmer", clock=clock, config={"housekeeping_interval_s": 120.0})
    client = Client(redis_url)
    rids = [client.submit([5, 6, 7 + i], model=MODEL, max_tokens=2) for i in range(3)]
    for rid in rids:
        assert client.result(rid, timeout=60).finish_reason is FinishReason.LENGTH
    eventually(lambda: redis_client.xpending(STREAM, GROUP)["pending"] == 0, "acknowledged")
    assert redis_client.xlen(STREAM) == 3  # served, and kept until a trim

    ticks = worker.reaper.ticks
    clock.advance(60.0)  # half the interval: the reaper runs, and trims nothing
    eventually(lambda: worker.reaper.ticks > ticks, "the reaper ticked")
    assert redis_client.xlen(STREAM) == 3

    clock.advance(60.0)
    eventually(lambda: redis_client.xlen(STREAM) == 0, "the served entries trimmed")
