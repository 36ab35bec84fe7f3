"""Prefill and decode workers on a real Redis: a prefill worker computes each prompt,
publishes the first token and hands the request on with its KV through the fleet tier; a
decode worker continues it. Float64 greedy outputs equal the offline engine, and the
decode worker computes no prompt token. Missing KV falls back to recomputing, exactly."""

from __future__ import annotations

import random
import re
import signal

from fleet_fixtures import MODEL
from waiting import eventually
from worker_processes import spawn_worker, stop_all, wait_ready

from producer.client.client import Client
from producer.client.models import LIVE, NO_LIVE_WORKER
from producer.client.queues import lane_stats
from producer.clock import ManualClock
from producer.wire.keys import GROUP, Keys
from producer.wire.protocol import FIELD, GenerationRequest, decode_output
from worker import Engine, FinishReason, SamplingParams
from worker.cli.top import render, take_snapshot

KEYS = Keys()

BIG_POOL = {"num_kv_blocks": 1200}


def _work(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    lengths = [20, 1500, 16, 17] + [rng.randint(20, 600) for _ in range(n - 4)]
    return [([rng.randrange(2, 1000) for _ in range(length)], rng.randint(2, 10))
            for length in lengths]


def _reference(tiny_llama, work) -> list[list[int]]:
    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=1200)
    done = engine.generate([p for p, _ in work],
                           [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                            for _, m in work])
    return [c.token_ids for c in done]


def _submit_all(client: Client, work) -> list[str]:
    return [client.submit(p, model=MODEL, max_tokens=m, temperature=0, ignore_eos=True)
            for p, m in work]


def test_a_prefill_and_a_decode_worker_equal_the_offline_engine(redis_url, start_worker,
                                                                tiny_llama):
    work = _work(16)
    reference = _reference(tiny_llama, work)
    prefill = start_worker(worker_id="prefill-0", config={"role": "prefill"}, **BIG_POOL)
    decode = start_worker(worker_id="decode-0", config={"role": "decode"}, **BIG_POOL)
    with Client(redis_url) as client:
        results = [client.result(rid, timeout=120) for rid in _submit_all(client, work)]
    for i, (ref, got) in enumerate(zip(reference, results, strict=True)):
        assert got.token_ids == ref, f"request {i} ({len(work[i][0])} prompt tokens)"
        assert got.usage.kv_transferred_tokens == got.usage.prompt_tokens == len(work[i][0])
    assert prefill.publisher.hand_on.handed_on == len(work)
    assert decode.status()["prompt_tokens_computed"] == 0  # every prompt's KV arrived
    assert decode.handoffs.imported == len(work) and not decode.handoffs.fallbacks
    put, got = prefill.publisher.hand_on.transfers, decode.handoffs.transfers
    assert put.count == got.count == len(work) and put.bytes == got.bytes > 0


def test_missing_kv_is_recomputed_and_still_exact(redis_url, start_worker, tiny_llama,
                                                 redis_client):
    work = _work(6, seed=1)
    reference = _reference(tiny_llama, work)
    prefill = start_worker(worker_id="prefill-0", config={"role": "prefill"}, **BIG_POOL)
    with Client(redis_url) as client:
        ids = _submit_all(client, work)
        # Every request handed on, none taken yet (no decode worker): its KV waits.
        eventually(lambda: prefill.publisher.hand_on.handed_on == len(work),
                   "every request handed on")
        prefill.heartbeat.beat()
        frame = render(take_snapshot(client))
        assert re.search(r"tiny\s+handoff-interactive\s+6\b", frame)  # six, none taken
        assert re.search(r"prefill-0\s+tiny\s+prefill", frame)
        kv_keys = redis_client.keys("conveyor:kv:{*")
        assert kv_keys  # the precondition: the handoffs' KV really is in the tier
        redis_client.delete(*kv_keys)  # an expiry, an operator, a failover
        decode = start_worker(worker_id="decode-0", config={"role": "decode"}, **BIG_POOL)
        results = [client.result(rid, timeout=120) for rid in ids]
    for ref, got in zip(reference, results, strict=True):
        assert got.token_ids == ref
        assert got.usage.kv_transferred_tokens == 0
    assert decode.handoffs.fallbacks["missing"] == len(work)
    assert decode.status()["prompt_tokens_computed"] == sum(len(p) for p, _ in work)


def test_a_model_is_live_only_with_both_halves_of_a_request(redis_url, start_worker):
    prefill = start_worker(worker_id="prefill-0", config={"role": "prefill"})
    prefill.heartbeat.beat()
    with Client(redis_url) as client:
        assert client.model_state(MODEL).state == NO_LIVE_WORKER  # nobody would decode
        start_worker(worker_id="decode-0", config={"role": "decode"}).heartbeat.beat()
        assert client.model_state(MODEL).state == LIVE


def _decoding_on(client: Client, worker: str, ids: list[str]) -> int:
    """Handed-on requests ``worker`` holds pending that already streamed past their first
    token (it is generating them)."""
    stream = KEYS.handoff(MODEL, "interactive")
    mine = {e["message_id"] for e in client.redis.xpending_range(
        stream, GROUP, "-", "+", 1000, consumername=worker)}
    held = 0
    for entry_id, fields in client.redis.xrange(stream):
        if entry_id in mine:
            rid = GenerationRequest.decode(fields[FIELD]).request_id
            held += rid in ids and client.redis.xlen(KEYS.output(rid)) > 2
    return held


def test_sigkill_of_a_decode_worker_mid_stream_loses_nothing(redis_url, tiny_llama, tmp_path):
    rng = random.Random(3)
    # Long outputs: the victim is still decoding when it is killed, however fast it runs.
    work = [([rng.randrange(2, 1000) for _ in range(rng.randint(20, 200))], 800)
            for _ in range(12)]
    reference = _reference(tiny_llama, work)
    client = Client(redis_url)
    roles = {"prefill": "prefill", "victim": "decode", "survivor": "decode"}
    procs = {name: spawn_worker(tiny_llama, redis_url, name, "--role", role, "--lease-ms",
                                "1500", log_dir=tmp_path) for name, role in roles.items()}
    try:
        for name, proc in procs.items():
            wait_ready(client, name, proc)
        # The survivor sits out the hand-ons: two decode workers reading at once split them
        # as their reads happened to fall, and the victim could hold fewer than three.
        procs["survivor"].send_signal(signal.SIGSTOP)
        ids = _submit_all(client, work)
        eventually(lambda: _decoding_on(client, "victim", ids) >= 3,
                   "the victim decoding 3 handed-on requests")
        procs["victim"].send_signal(signal.SIGKILL)
        procs["survivor"].send_signal(signal.SIGCONT)
        procs["victim"].wait(timeout=10)
        results = [client.result(rid, timeout=180) for rid in ids]
        for rid, got, want in zip(ids, results, reference, strict=True):
            assert got.token_ids == want
            indexes = [i for _, f in client.redis.xrange(KEYS.output(rid))
                       if hasattr(e := decode_output(f[FIELD]), "index")
                       for i in range(e.index, e.index + len(e.token_ids))]
            assert indexes == list(range(len(want)))  # each index once, in order
    finally:
        stop_all(list(procs.values()))


def test_a_tier_that_refuses_every_write_still_ends_exact(redis_url, start_worker, tiny_llama):
    work = _work(5, seed=2)
    reference = _reference(tiny_llama, work)
    # A tier bound far below any prompt's KV: every put is refused.
    prefill = start_worker(worker_id="prefill-0", config={"role": "prefill", "kv_max_bytes": 1},
                           **BIG_POOL)
    decode = start_worker(worker_id="decode-0", config={"role": "decode"}, **BIG_POOL)
    with Client(redis_url) as client:
        results = [client.result(rid, timeout=120) for rid in _submit_all(client, work)]
    assert prefill.publisher.hand_on.kv_refused == len(work)  # the writes really were refused
    for ref, got in zip(reference, results, strict=True):
        assert got.token_ids == ref and got.usage.kv_transferred_tokens == 0
    assert decode.handoffs.fallbacks["missing"] == len(work)


def test_a_document_analysed_on_one_worker_serves_questions_on_a_fresh_one(
        redis_url, start_worker, tiny_llama):
    rng = random.Random(5)
    document = [rng.randrange(2, 1000) for _ in range(1500)]
    questions = [[rng.randrange(2, 1000) for _ in range(rng.randint(5, 15))] for _ in range(4)]
    prompts = [document + q for q in questions]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reference = Engine(tiny_llama, dtype="float64", num_kv_blocks=1200,
                       enable_prefix_caching=False).generate(prompts, params)
    full_blocks = 1500 // 16
    share = {"kv_share_prefixes": True}
    a = start_worker(worker_id="a", config=share, **BIG_POOL)
    with Client(redis_url) as client:
        analysis = document + [7, 8, 9]
        client.result(client.submit(analysis, model=MODEL, max_tokens=4, temperature=0),
                      timeout=120)
        eventually(lambda: a.publisher.prefixes.blocks_put >= full_blocks,
                   "worker A put the document's blocks in the tier")
        a.stop()
        b = start_worker(worker_id="b", config=share, **BIG_POOL)
        ids = [client.submit(p, model=MODEL, max_tokens=6, temperature=0, ignore_eos=True)
               for p in prompts]
        results = [client.result(rid, timeout=120) for rid in ids]
    for ref, got in zip(reference, results, strict=True):
        assert got.token_ids == ref.token_ids
        # From the tier, or from B's own cache once a first question had brought it there.
        assert got.usage.kv_transferred_tokens + got.usage.cached_tokens >= full_blocks * 16
    assert max(r.usage.kv_transferred_tokens for r in results) >= full_blocks * 16
    assert b.prefix_finder.hits >= 1
    # B never computed the document: only the questions' tokens (and a block's remainder).
    assert b.status()["prompt_tokens_computed"] < 4 * (16 + 15)


def test_a_hand_on_goes_through_when_the_tier_is_unreachable(redis_client, tiny_llama):
    from kvstore.handoff import KVHandoff
    from kvstore.tier.redis_tier import RedisKVTier
    from producer.client.connection import connect
    from worker.fleet.handoff.engine_kv import kv_layout
    from worker.fleet.handoff.handoff import HandOnWriter
    from worker.fleet.messages import HandOn

    lane = KEYS.requests(MODEL, "interactive")
    redis_client.xgroup_create(lane, GROUP, id="0", mkstream=True)
    entry = redis_client.xadd(lane, {FIELD: b"request"})
    redis_client.xreadgroup(GROUP, "w", {lane: ">"})  # "w" owns the entry now
    layout = kv_layout(Engine(tiny_llama, dtype="float64", num_kv_blocks=8))
    nowhere = RedisKVTier(connect("redis://127.0.0.1:1/0", retry_attempts=0))
    writer = HandOnWriter(redis_client, nowhere, lambda: layout, KEYS, MODEL, "w")
    kv = KVHandoff(16, b"\0" * layout.bytes_per_block)
    writer.write(HandOn("r1", lane, entry.decode(), b"request", FIELD, kv))
    assert writer.kv_refused == 1  # the tier really could not be reached
    assert writer.handed_on == 1 and redis_client.xlen(KEYS.handoff(MODEL, "interactive")) == 1
    assert redis_client.xpending(lane, GROUP)["pending"] == 0  # acknowledged with it


def test_a_cancel_holds_across_the_handoff(redis_url, start_worker):
    prefill = start_worker(worker_id="prefill-0", config={"role": "prefill"})
    with Client(redis_url) as client:
        # Cancelled while waiting in the handoff stream (no decode worker yet).
        waiting = client.submit([5] * 40, model=MODEL, max_tokens=500, temperature=0,
                                ignore_eos=True)
        eventually(lambda: prefill.publisher.hand_on.handed_on == 1, "handed on")
        client.cancel(waiting)
        decode = start_worker(worker_id="decode-0", config={"role": "decode"})
        assert client.result(waiting, timeout=60).finish_reason == FinishReason.CANCELLED
        # Cancelled while the decode worker generates it.
        running = client.submit([6] * 40, model=MODEL, max_tokens=2000, temperature=0,
                                ignore_eos=True)
        eventually(lambda: client.redis.xlen(KEYS.output(running)) > 3,
                   "the decode worker streaming it")
        client.cancel(running)
        done = client.result(running, timeout=60)
    assert done.finish_reason == FinishReason.CANCELLED and len(done.token_ids) < 2000
    assert decode.inflight.wait_empty(30)


def test_handed_on_requests_keep_their_lane_and_interactive_is_read_first():
    from worker.fleet.handoff.handoff import streams_for

    handoffs = [KEYS.handoff(MODEL, "interactive"), KEYS.handoff(MODEL, "batch")]
    lanes = [KEYS.requests(MODEL, "interactive"), KEYS.requests(MODEL, "batch")]
    assert streams_for(KEYS, MODEL, "decode") == handoffs
    assert streams_for(KEYS, MODEL, "both") == handoffs + lanes
    assert streams_for(KEYS, MODEL, "prefill") == lanes
    assert KEYS.lane_of(lanes[1]) == "batch" and KEYS.lane_of(handoffs[0]) == "interactive"


def test_a_deadline_holds_across_the_handoff(redis_url, start_worker):
    clock = ManualClock()  # the producer's and the workers': the deadline passes when it moves
    prefill = start_worker(worker_id="prefill-0", config={"role": "prefill"}, clock=clock)
    with Client(redis_url, clock=clock) as client:
        rid = client.submit([5] * 40, model=MODEL, max_tokens=500, temperature=0,
                            ignore_eos=True, timeout=5.0)
        eventually(lambda: prefill.publisher.hand_on.handed_on == 1, "handed on")
        clock.advance(10.0)  # past its deadline while it waits for a decode worker
        start_worker(worker_id="decode-0", config={"role": "decode"}, clock=clock)
        done = client.result(rid, timeout=60)
    assert done.finish_reason is FinishReason.EXPIRED
    assert done.token_ids[:1] and len(done.token_ids) < 500  # its first token, kept


def test_a_prefill_worker_reads_nothing_while_decode_workers_are_behind(
        redis_url, start_worker, redis_client, tiny_llama):
    # Three requests already wait in the handoff stream (decode workers are behind): a
    # prefill worker bounded at three takes no new one until they are taken.
    handoff = KEYS.handoff(MODEL, "interactive")
    redis_client.xgroup_create(handoff, GROUP, id="0", mkstream=True)
    backlog = [redis_client.xadd(handoff, {FIELD: b"waiting"}) for _ in range(3)]
    prefill = start_worker(worker_id="prefill-0",
                           config={"role": "prefill", "handoff_max_waiting": 3})
    with Client(redis_url) as client:
        rid = client.submit([5, 6, 7], model=MODEL, max_tokens=3, temperature=0,
                            ignore_eos=True)
        ticks = prefill.intake.ticks
        eventually(lambda: prefill.intake.ticks >= ticks + 3, "the intake looked three times")
        assert prefill.intake.handoff_backlog == 3
        interactive = lane_stats(redis_client, KEYS, MODEL)[0]
        assert (interactive.depth, interactive.pending) == (1, 0)  # the request was not read
        assert prefill.intake.num_read == 0

        redis_client.xdel(handoff, *backlog)  # the decode workers caught up
        eventually(lambda: prefill.publisher.hand_on.handed_on == 1, "the request handed on")
        decode = start_worker(worker_id="decode-0", config={"role": "decode"})
        assert client.result(rid, timeout=60).token_ids == _reference(
            tiny_llama, [([5, 6, 7], 3)])[0]
    assert decode.handoffs.imported == 1
