"""Nothing a worker keeps per request outlives the request: 500 requests with expiries,
lease losses and reused ids leave every per-request structure at its idle size."""

from __future__ import annotations

from fleet_fixtures import MODEL
from waiting import eventually

from producer.client.client import Client
from producer.clock import ManualClock
from producer.wire.completion import FinishReason
from producer.wire.keys import GROUP, Keys

KEYS = Keys()
STREAM = KEYS.requests(MODEL, "interactive")
ROUND = 50



def idle_sizes(worker) -> dict[str, int]:
    engine, loop = worker.engine, worker.loop
    return {
        "in flight": len(worker.inflight),
        "engine outputs": len(engine._outputs),
        "engine deadlines": len(engine._deadlines),
        "scheduler requests": len(engine.scheduler.requests),
        "scheduler waiting heap": len(engine.scheduler._waiting),
        "publisher text states": worker.publisher.text.num_followed,
        "publisher stream TTLs": len(worker.publisher._lives_until),
        "engine steps under way": int(engine._pipeline is not None and engine._pipeline.busy),
        "engine loop ends and drops": len(loop._ends) + len(loop._drops),
    }


def test_500_requests_with_expiries_lease_losses_and_reused_ids_leave_nothing(
        redis_url, redis_client, start_worker):
    clock = ManualClock()
    worker = start_worker("tidy", clock=clock, max_num_seqs=64)
    client = Client(redis_url, clock=clock)
    reader = Client(redis_url)  # waits on real time: the manual clock stands still
    long = dict(max_tokens=1000, temperature=0, ignore_eos=True)
    served = 0

    # 200: a hundred ids, each used twice (the second time after the first finished).
    for _ in range(2):
        ids = [client.submit([5, 6, i % 50 + 7], model=MODEL, request_id=f"again-{i}",
                             max_tokens=3, temperature=0) for i in range(100)]
        assert {reader.result(rid, timeout=60).finish_reason for rid in ids} == {
            FinishReason.LENGTH}
        served += len(ids)

    for _ in range(3):
        # 50 whose deadline passes while they generate.
        ids = [client.submit([5, 6, 7], model=MODEL, timeout=1.0, **long) for _ in range(ROUND)]
        for rid in ids:
            next(reader.stream(rid, timeout=60))  # generating, before its deadline
        clock.advance(2.0)
        assert {reader.result(rid, timeout=60).finish_reason for rid in ids} == {
            FinishReason.EXPIRED}
        # 50 whose lease another worker takes while they are in flight here.
        worker.loop.pause()
        ids = [client.submit([5, 6, 8], model=MODEL, **long) for _ in range(ROUND)]
        eventually(lambda ids=ids: all(rid in worker.inflight for rid in ids), "all read")
        entries = [worker.inflight.get(rid).entry_id for rid in ids]
        redis_client.xclaim(STREAM, GROUP, "thief", 0, entries, justid=True)
        clock.advance(worker.leases.renew_every_s)  # the next renewal is due
        eventually(lambda: len(worker.inflight) == 0, "every lost lease noticed and dropped")
        worker.loop.resume()
        redis_client.xack(STREAM, GROUP, *entries)  # the thief's business, not this test's
        served += 2 * ROUND

    assert served == 500
    # Each lost lease counted (what was admitted here is finished here or lost).
    assert worker.metrics.registry.get_sample_value(
        "conveyor_leases_lost_total", {"model": MODEL}) == 3 * ROUND
    eventually(lambda: not any(idle_sizes(worker).values()), "the worker at its idle size", 120)
    assert idle_sizes(worker) == dict.fromkeys(idle_sizes(worker), 0)


def test_the_dead_letter_streams_worst_case_stays_under_64_mib():
    from worker.fleet.publishing.publisher import DEAD_LETTER_MAXLEN, Rejection, dead_letter_fields

    longest_stream = KEYS.requests("m" * 128, "interactive")
    worst = Rejection(longest_stream, f"{2**64 - 1}-{2**64 - 1}", "é" * 2**20, "r" * 64,
                      raw=b"x" * 4 * 2**20)
    fields = dead_letter_fields(worst, "w" * 128, 253_402_300_799_999)
    size = sum(len(k) + len(v.encode() if isinstance(v, str) else v)
               for k, v in fields.items())
    # XADD with an approximate MAXLEN keeps up to one more stream node (100 entries); allow
    # 64 bytes an entry for the entry id and the stream's own bookkeeping.
    assert (DEAD_LETTER_MAXLEN + 100) * (size + 64) <= 64 * 2**20
    assert fields["raw_bytes"] == str(4 * 2**20)
