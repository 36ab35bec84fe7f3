"""Prefix affinity (docs/affinity.md): requests that share a prompt
prefix go to the worker that holds it, and never wait on it for long: a busy owner's
requests are taken over after the delay, a dead or draining owner's at once."""

from __future__ import annotations

import threading
import time

import pytest
from fleet_fixtures import MODEL, settled_pending
from hf_reference import hf_greedy
from waiting import eventually

from producer.affinity.prefix_keys import (
    CARRIED_LEVELS,
    LEVELS,
    MIN_SHARE,
    canonical_bytes,
    prefix_keys,
)
from producer.affinity.routing import OWNER_GENERATION_S, generation
from producer.client.client import Client, QueueFull
from producer.client.queues import lane_stats
from producer.clock import ManualClock
from producer.wire.keys import GROUP, Keys
from producer.wire.protocol import FIELD, GenerationRequest

KEYS = Keys()
DOC = list(range(2, 702))  # 700 tokens (2,800 bytes): carries keys up to level 2,304
# The tiny model's prefix cache keeps whole 16-token blocks of the document.
DOC_HIT = len(DOC) // 16 * 16


def ask(question: int) -> list[int]:
    return [*DOC, 500 + question, 600 + question, 700 + question]


# ----- the keys -----

def test_prompts_that_share_an_opening_share_its_keys_and_kinds_never_collide():
    a = prefix_keys(canonical_bytes(token_ids=ask(1)))
    b = prefix_keys(canonical_bytes(token_ids=ask(2)))
    assert a.keys and a.keys == b.keys  # the questions fall after the deepest level
    assert len(a.keys) <= CARRIED_LEVELS
    assert prefix_keys(canonical_bytes(token_ids=list(range(2, 60)))).keys == ()  # too short
    text = "x" * 2000
    as_text = prefix_keys(canonical_bytes(prompt=text)).keys
    as_chat = prefix_keys(canonical_bytes(messages=[{"role": "user", "content": text}])).keys
    assert as_text and as_chat and not set(as_text) & set(as_chat)
    # Tools come first, as templates render them: other tools, other keys.
    tool = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = [{"role": "user", "content": text}]
    assert prefix_keys(canonical_bytes(messages=chat, tools=tool)).keys[-1] != as_chat[-1]


def test_a_producer_follows_only_an_owner_of_most_of_its_prompt():
    # A shared opening of a fifth of a prompt (a common system prompt) sends nowhere.
    found = prefix_keys(b"y" * 10_000)
    deepest = max(i for i, level in enumerate(LEVELS) if level <= 10_000)
    looked = found.lookup()
    assert looked and looked[-1] == found.keys[-1]
    assert all(LEVELS[deepest - (len(found.keys) - 1 - found.keys.index(k))]
               >= MIN_SHARE * 10_000 for k in looked)
    assert len(looked) < len(found.keys)


# ----- a fleet of two workers -----

def _lane_of(r, request_id: str) -> str:
    """The request lane (shared or a worker's affinity lane) holding ``request_id``."""
    lanes = [k.decode() for k in r.keys(KEYS.affinity_lane_pattern(MODEL))]
    for lane in [*lanes, KEYS.requests(MODEL, "interactive")]:
        for _, fields in r.xrange(lane):
            if GenerationRequest.decode(fields[FIELD]).request_id == request_id:
                return lane
    raise AssertionError(f"{request_id} on no lane")


def _owner(r, prompt: list[int]) -> str | None:
    key = prefix_keys(canonical_bytes(token_ids=prompt)).keys[-1]
    value = r.hget(KEYS.affinity_owners(MODEL, generation(time.time())), key)
    return value.decode() if value else None


def _hits(worker) -> int:
    return worker.engine.stats()["prefix_cache_hit_tokens"]


def _busy(owner, client: Client, question: int) -> str:
    """Fill ``owner`` (one seat, no prefetch): a request sharing the prefix it holds, held
    by its paused engine loop. Returns the request's id."""
    owner.loop.pause()
    rid = client.submit(ask(question), model=MODEL, max_tokens=4, temperature=0)
    eventually(lambda: len(owner.inflight) == 1, "the owner holding a request")
    assert owner.inflight.room() == 0  # the precondition: it reads nothing more
    return rid


def _pair(start_worker, redis_url, redis_client, delay_ms: int):
    """(the owner of DOC, a second worker, ask(0)'s greedy answer): the owner served ask(0)
    alone before the second worker started. The owner has one seat and no prefetch, so one
    request fills it; the second worker takes a full worker's request after ``delay_ms``,
    a dead or draining one's at once."""
    redis_client.flushall()
    owner = start_worker("wa", prefetch=0, max_num_seqs=1)
    with Client(redis_url) as client:
        answer = client.result(client.submit(ask(0), model=MODEL, max_tokens=6,
                                             temperature=0), timeout=60).token_ids
    eventually(lambda: _owner(redis_client, ask(0)) == "wa", "the prefix advertised")
    other = start_worker("wb", config={"affinity_delay_ms": delay_ms})
    return owner, other, answer


@pytest.fixture
def owned(start_worker, redis_url, redis_client):
    """_pair with a second worker that waits 600 s for a full one."""
    return _pair(start_worker, redis_url, redis_client, 600_000)


def test_requests_sharing_a_prefix_go_to_the_worker_that_holds_it(owned, redis_url,
                                                                  redis_client, tiny_llama):
    owner, other, _ = owned
    before = _hits(owner)
    with Client(redis_url) as client:
        for q in range(1, 5):
            rid = client.submit(ask(q), model=MODEL, max_tokens=3, temperature=0)
            assert _lane_of(redis_client, rid) == KEYS.affinity_lane(MODEL, "wa", "interactive")
            # exact, its prefix from the cache: transformers' greedy answer
            assert client.result(rid, timeout=60).token_ids == hf_greedy(
                tiny_llama, ask(q), 3).token_ids
    assert _hits(owner) - before == 4 * DOC_HIT  # each found the document cached
    assert _hits(other) == 0 and other.intake.takeover.taken == 0
    assert settled_pending(redis_client) == 0


def test_a_busy_owners_request_is_taken_over_after_the_delay(start_worker, redis_url,
                                                             redis_client, tiny_llama):
    owner, taker, answer = _pair(start_worker, redis_url, redis_client, 1500)
    with Client(redis_url) as client:
        held = _busy(owner, client, 1)
        rid = client.submit(ask(0), model=MODEL, max_tokens=6, temperature=0)
        lane = KEYS.affinity_lane(MODEL, "wa", "interactive")
        assert _lane_of(redis_client, rid) == lane  # the precondition: it waits for wa
        time.sleep(0.5)  # (less than the delay: not taken yet, however slow this machine)
        assert _undelivered(redis_client, lane) == 1
        done = client.result(rid, timeout=60)
        assert taker.intake.takeover.taken == 1
        assert done.token_ids == answer  # the same greedy answer, its prefix computed again
        assert answer == hf_greedy(tiny_llama, ask(0), 6).token_ids
        assert _owner(redis_client, ask(0)) == "wa"  # still the live owner's
        owner.loop.resume()
        client.result(held, timeout=60)
    assert settled_pending(redis_client) == 0
    # (its reads since were empty: the taker wrote no key at all, before or after)
    assert taker.intake.advertiser.advertised == 0 and _owner(redis_client, ask(0)) == "wa"


def test_a_worker_is_busy_once_a_step_or_a_wait_for_the_batch_lasts_half_the_delay():
    from worker.fleet.affinity.busy import BusyOwner, EngineState

    clock = ManualClock()
    state = EngineState(None, None)
    owner = BusyOwner(lambda: state, delay_ms=250, clock=clock)
    assert not owner.check() and not owner.stepping  # idle
    state = EngineState(clock.monotonic(), None)  # a step begins
    clock.advance(0.124)
    assert not owner.check() and owner.stepping
    clock.advance(0.002)
    assert owner.check() and owner.busy  # one step for half the delay: a long prefill
    state = EngineState(None, clock.monotonic())  # it ended; a request waits for the batch
    assert not owner.check()
    clock.advance(0.2)
    assert owner.check() and not owner.stepping  # waiting counts between steps too
    state = EngineState(None, None)
    assert not owner.check() and not owner.busy


def test_a_busy_owners_own_lane_is_left_to_a_peer(start_worker, redis_url, redis_client,
                                                  tiny_llama):
    """An owner whose engine has a request waiting for its batch reads its affinity lane no
    more and says it has no room: a peer takes the next question after the delay."""
    redis_client.flushall()
    owner = start_worker("wa", prefetch=4, max_num_seqs=1)
    with Client(redis_url) as client:
        client.result(client.submit(ask(0), model=MODEL, max_tokens=2, temperature=0),
                      timeout=60)
        eventually(lambda: _owner(redis_client, ask(0)) == "wa", "the prefix advertised")
        taker = start_worker("wb", config={"affinity_delay_ms": 300})
        eventually(lambda: "wb" in client.model_state(MODEL).affinity_workers, "wb live")
        long = client.submit(ask(1), model=MODEL, max_tokens=1300, temperature=0,
                             ignore_eos=True)
        queued = client.submit(ask(2), model=MODEL, max_tokens=2, temperature=0)
        eventually(lambda: owner.loop.engine_state().waiting_since is not None,
                   "a request waiting for the owner's one seat")
        owner.loop.pause()  # (it stays so: no step ends the wait)
        # Busy, and seeing a peer with room (with none it reads its own lanes itself): its
        # reads leave its own lanes to wb from now on.
        eventually(lambda: owner.intake.leaving_own_lanes, "the owner leaving its lanes")
        eventually(lambda: redis_client.hget(KEYS.worker("wa"), "room") == b"0",
                   "the owner saying it has no room")
        rid = client.submit(ask(3), model=MODEL, max_tokens=3, temperature=0)
        assert _lane_of(redis_client, rid) == KEYS.affinity_lane(MODEL, "wa", "interactive")
        done = client.result(rid, timeout=60)
        assert taker.intake.takeover.taken == 1
        assert done.token_ids == hf_greedy(tiny_llama, ask(3), 3).token_ids
        client.cancel(long)
        owner.loop.resume()
        assert client.result(queued, timeout=60).finish_reason == "length"
    assert settled_pending(redis_client) == 0


def _undelivered(r, lane: str) -> int:
    group = next(g for g in r.xinfo_groups(lane) if g["name"].decode() == GROUP)
    return len(r.xrange(lane, min=f"({group['last-delivered-id'].decode()}"))


def test_a_dead_owners_requests_are_taken_over_at_once(owned, redis_url, redis_client):
    owner, taker, answer = owned
    with Client(redis_url) as client:
        held = _busy(owner, client, 1)
        rid = client.submit(ask(0), model=MODEL, max_tokens=6, temperature=0)
        lane = KEYS.affinity_lane(MODEL, "wa", "interactive")
        assert _lane_of(redis_client, rid) == lane
        time.sleep(0.3)
        assert _undelivered(redis_client, lane) == 1  # the taker waits 600 s for a live owner
        # It dies: its heartbeat lapses.
        owner.heartbeat.stop()
        redis_client.delete(KEYS.worker("wa"))
        done = client.result(rid, timeout=60)
        assert done.token_ids == answer
        assert taker.intake.takeover.taken == 1
        # The prefix is the taker's now: the next question goes to it.
        eventually(lambda: _owner(redis_client, ask(0)) == "wb", "the prefix taken over")
        owner.loop.resume()
        client.result(held, timeout=60)


def test_a_draining_owners_requests_are_taken_over_and_max_queue_counts_them(
        owned, redis_url, redis_client):
    owner, taker, _ = owned
    clock = ManualClock()  # the producer's view of the live workers never goes stale here
    # ... and its clock names another generation of the owners than the workers': it reads
    # the one their heartbeats name
    assert generation(clock.time()) != generation(time.time())
    with Client(redis_url, clock=clock) as client:
        held = _busy(owner, client, 1)
        with pytest.raises(QueueFull):  # what an affinity lane holds counts
            client.submit([7, 8], model=MODEL, max_tokens=1, max_queue=1)
        # ... and shows in `conveyor top` and the workers' lane metrics
        assert lane_stats(redis_client, KEYS, MODEL)[0].pending == 1
        draining = threading.Thread(target=owner.stop, kwargs={"drain_timeout_s": 60})
        draining.start()
        eventually(lambda: owner.state == "draining", "the owner draining")
        rid = client.submit(ask(2), model=MODEL, max_tokens=4, temperature=0)
        assert _lane_of(redis_client, rid) == KEYS.affinity_lane(MODEL, "wa", "interactive")
        done = client.result(rid, timeout=60)
        assert done.finish_reason == "length" and taker.intake.takeover.taken == 1
        owner.loop.resume()
        assert client.result(held, timeout=60).finish_reason == "length"
        draining.join(60)
    assert settled_pending(redis_client) == 0


def test_plain_pull_sends_nothing_to_affinity_lanes(start_worker, redis_url, redis_client):
    redis_client.flushall()
    worker = start_worker("wa", config={"affinity": False})
    assert KEYS.affinity_lane(MODEL, "wa", "interactive") not in worker.intake.streams
    with Client(redis_url, affinity=False) as client:
        rid = client.submit(ask(0), model=MODEL, max_tokens=2, temperature=0)
        assert _lane_of(redis_client, rid) == KEYS.requests(MODEL, "interactive")
        client.result(rid, timeout=60)
    assert not redis_client.keys(KEYS.affinity_pattern)


def test_the_take_script_takes_only_what_waited_long_enough_or_was_left(each_redis):
    from producer.client.connection import connect
    from worker.fleet.affinity.fleet_view import FleetView
    from worker.fleet.affinity.takeover import Takeover
    from worker.fleet.intake.intake import ensure_groups

    r = connect(each_redis.url)
    r.flushall()
    lane = KEYS.affinity_lane(MODEL, "wa", "interactive")
    ensure_groups(r, [lane])
    r.sadd(KEYS.affinity_lanes(MODEL), "wa", "wb")
    r.hset(KEYS.worker("wa"), mapping={"status": "serving", "model": MODEL, "affinity": "1",
                                       "room": "0"})  # a full worker
    ids = [r.xadd(lane, {FIELD: b"x%d" % i}).decode() for i in range(4)]
    view = FleetView(r, KEYS, MODEL, "wb", clock=ManualClock())
    patient = Takeover(r, KEYS, MODEL, "wb", view, delay_ms=600_000)
    assert patient.take(8) == []  # a live worker's requests, not waiting that long
    assert Takeover(r, KEYS, MODEL, "wb", view, delay_ms=0).take(1) == [
        (lane, ids[0], {FIELD: b"x0"})]
    r.hset(KEYS.worker("wa"), "affinity", "")  # restarted without affinity: its lane is left
    view.refresh(force=True)
    assert [entry for _, entry, _ in patient.take(1)] == ids[1:2]  # at once
    r.hset(KEYS.worker("wa"), mapping={"affinity": "1", "status": "draining"})
    view.refresh(force=True)
    assert [entry for _, entry, _ in patient.take(8)] == ids[2:]  # at once, whatever waited
    assert patient.take(8) == []
    assert {c["name"].decode(): c["pending"] for c in r.xinfo_consumers(lane, GROUP)} == {
        "wb": 4}
    r.close()


def test_an_advertisement_is_one_write_a_generation_and_leaves_a_live_owners_keys(
        each_redis):
    """A read's new keys cost one HSET into now's owners' hash and one into the next's (each
    hash set to expire once); the same keys again in that generation cost nothing, and are
    written once more when it turns. A request taken from a live worker's lane leaves its
    keys to that worker; one from a gone worker's lane names the taker."""
    from producer.client.connection import connect
    from producer.wire.protocol import SamplingParams
    from worker.fleet.affinity.advertise import Advertiser
    from worker.fleet.affinity.fleet_view import FleetView
    from worker.fleet.messages import Admission

    r = connect(each_redis.url)
    r.flushall()
    clock = ManualClock()
    view = FleetView(r, KEYS, MODEL, "wb", clock=clock)
    r.sadd(KEYS.affinity_lanes(MODEL), "wa", "wb")
    r.hset(KEYS.worker("wa"), mapping={"status": "serving", "model": MODEL, "affinity": "1"})
    advertiser = Advertiser(r, KEYS, MODEL, "wb", view, clock)

    def admitted(prompt: list[int], stream: str) -> Admission:
        found = prefix_keys(canonical_bytes(token_ids=prompt))
        req = GenerationRequest(request_id=f"r{len(prompt)}-{stream[-3:]}", model=MODEL,
                                prompt_token_ids=prompt, params=SamplingParams(max_tokens=1),
                                affinity=list(found.keys))
        return Admission(request=req, prompt_token_ids=prompt, stream=stream, entry_id="1-0")

    def owners(at: float) -> dict[str, str]:
        name = KEYS.affinity_owners(MODEL, generation(at))
        return {k.decode(): v.decode() for k, v in r.hgetall(name).items()}

    shared = KEYS.requests(MODEL, "interactive")
    busy_owner = KEYS.affinity_lane(MODEL, "wa", "interactive")
    r.config_resetstat()
    advertiser.advertise([admitted(ask(0), shared), admitted(ask(1), shared),
                          admitted([*range(3, 400), 9], busy_owner)])
    stats = r.info("commandstats")
    assert stats["cmdstat_hset"]["calls"] == 2 and stats["cmdstat_expire"]["calls"] == 2
    keys = set(prefix_keys(canonical_bytes(token_ids=ask(0))).keys) | set(
        prefix_keys(canonical_bytes(token_ids=ask(1))).keys)
    now = clock.time()
    assert owners(now) == owners(now + OWNER_GENERATION_S) == dict.fromkeys(keys, "wb")
    assert 0 < r.ttl(KEYS.affinity_owners(MODEL, generation(now))) <= 2 * OWNER_GENERATION_S + 1
    # (ask(0) and ask(1) open with one document: one prefix new to it)
    assert advertiser.owned == 1 and r.hget(KEYS.affinity_owned(MODEL), "wb") == b"1"

    r.config_resetstat()
    advertiser.advertise([admitted(ask(0), KEYS.affinity_lane(MODEL, "wb", "interactive"))])
    assert "cmdstat_hset" not in r.info("commandstats")  # written this generation already
    clock.advance(OWNER_GENERATION_S)
    advertiser.advertise([admitted(ask(0), shared)])
    stats = r.info("commandstats")
    assert stats["cmdstat_hset"]["calls"] == 2 and stats["cmdstat_expire"]["calls"] == 1
    assert advertiser.owned == 1  # renewed, not new

    r.delete(KEYS.worker("wa"))  # gone: what is taken from its lane becomes the taker's
    clock.advance(1.0)
    advertiser.advertise([admitted([*range(3, 400), 9], busy_owner)])
    assert set(prefix_keys(canonical_bytes(token_ids=[*range(3, 400), 9])).keys) <= set(
        owners(clock.time()))
    assert advertiser.owned == 2
    r.close()


def test_a_gone_workers_lanes_are_forgotten_once_empty_and_long_gone(each_redis):
    from producer.client.connection import connect
    from producer.client.queues import trim_request_stream
    from worker.fleet.affinity.fleet_view import FleetView
    from worker.fleet.affinity.pruning import PRUNE_AFTER_S, LanePruner
    from worker.fleet.intake.intake import ensure_groups

    r = connect(each_redis.url)
    r.flushall()
    lanes = [KEYS.affinity_lane(MODEL, "wz", lane) for lane in ("interactive", "batch")]
    ensure_groups(r, lanes)
    r.sadd(KEYS.affinity_lanes(MODEL), "wz", "wb")
    r.hset(KEYS.affinity_owned(MODEL), mapping={"wz": 4, "wb": 2})
    entry = r.xadd(lanes[0], {FIELD: b"x"})  # one request still waits there
    clock = ManualClock()
    view = FleetView(r, KEYS, MODEL, "wb", clock=clock)
    view.refresh(force=True)
    pruner = LanePruner(r, KEYS, MODEL, view, clock)
    assert pruner.prune() == 0  # gone (no heartbeat) from now on, as this reaper sees it
    clock.advance(PRUNE_AFTER_S)
    assert pruner.prune() == 0 and r.exists(lanes[0])  # ... but its lane is not empty
    r.xreadgroup(GROUP, "wb", {lanes[0]: ">"})
    r.xack(lanes[0], GROUP, entry)
    trim_request_stream(r, lanes[0])
    assert pruner.prune() == 1
    assert not any(r.exists(lane) for lane in lanes)
    assert r.smembers(KEYS.affinity_lanes(MODEL)) == {b"wb"}
    assert r.hgetall(KEYS.affinity_owned(MODEL)) == {b"wb": b"2"}
    r.close()


def test_new_prefixes_go_to_the_workers_that_own_fewest(owned, redis_url, redis_client):
    """A worker owning more prefixes than a peer with room (beyond a margin) yields new
    ones to it: new documents spread over the two."""
    from worker.fleet.affinity.fleet_view import OWNED_MARGIN

    owner, other, _ = owned
    assert other.intake.advertiser.owned == owner.intake.advertiser.owned == 1  # joined even
    with Client(redis_url) as client:
        for doc in range(1, 7):
            prompt = [(d * 7 + doc * 131) % 1000 + 2 for d in DOC[:500]] + [7]
            done = client.result(client.submit(prompt, model=MODEL, max_tokens=2,
                                               temperature=0), timeout=60)
            assert done.finish_reason == "length"
            eventually(lambda p=prompt: _owner(redis_client, p), "the prefix advertised")
    counts = {k.decode(): int(v) for k, v in redis_client.hgetall(
        KEYS.affinity_owned(MODEL)).items()}
    assert counts == {"wa": owner.intake.advertiser.owned, "wb": other.intake.advertiser.owned}
    assert sum(counts.values()) == 8 and abs(counts["wa"] - counts["wb"]) <= OWNED_MARGIN + 1


def test_the_async_client_places_and_counts_as_the_client_does(owned, redis_url,
                                                               redis_client):
    """The gateway's client: a request sharing the owner's prefix goes to its lane, and
    max_queue counts what is held there."""
    import asyncio

    from producer.client.async_client import AsyncClient

    owner, _, answer = owned

    async def go():
        async with AsyncClient(redis_url) as client:
            rid = await client.submit(ask(0), model=MODEL, max_tokens=6, temperature=0)
            done = await client.result(rid, timeout=60)
            with Client(redis_url) as sync:
                held = _busy(owner, sync, 1)  # it holds one request: its lane has it
            with pytest.raises(QueueFull):
                await client.submit([7, 8], model=MODEL, max_tokens=1, max_queue=1)
            owner.loop.resume()
            await client.result(held, timeout=60)
            return rid, done

    rid, done = asyncio.run(go())
    assert _lane_of(redis_client, rid) == KEYS.affinity_lane(MODEL, "wa", "interactive")
    assert done.token_ids == answer
