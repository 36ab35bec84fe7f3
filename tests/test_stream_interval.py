"""A worker's ``stream_interval``: a decoding request's tokens go out N at a time, its first
token and its end at once, and nothing is held past the step that no longer runs it. The
stream's content (tokens, text, entry ids as token indexes) is the same as chunk by chunk."""

from __future__ import annotations

import random
from dataclasses import replace

import msgpack
import pytest
import redis
from fleet_fixtures import MODEL, settled_pending
from redis_fixtures import REDIS_VERSIONS, redis_binary

from producer.client.client import Client
from producer.client.connection import connect
from producer.clock import ManualClock, SystemClock
from producer.redis.server import start_ephemeral
from producer.wire.keys import Keys
from producer.wire.protocol import FIELD, ID_GENERATION, FinalEntry, OutputChunk
from worker import Engine, SamplingParams
from worker.fleet.config import WorkerConfig
from worker.fleet.inflight import InflightRequest
from worker.fleet.intake.resume import Published, read_published, take_over
from worker.fleet.messages import SharePrefix
from worker.fleet.publishing.chunk_holder import ChunkHolder
from worker.fleet.publishing.publisher import Publication, Publisher, WriteRefused
from worker.fleet.publishing.text_stage import TextStage
from worker.fleet.publishing.token_hold import TokenHold

KEYS = Keys()


def step(rid: str, index: int, logprobs: bool = False, id_base: int = 0) -> Publication:
    """One decode step's output of ``rid``: token ``index`` (in the ids from ``id_base``)."""
    lp = [[-0.5, [[100 + index, -0.5]]]] if logprobs else None
    return Publication(rid, OutputChunk(index, [100 + index], f"t{index} ", lp,
                                        id_base=id_base))


def final(rid: str, index: int, ack: tuple[str, str] | None = ("stream", "1-0")) -> Publication:
    """The step that ends ``rid`` with token ``index`` (and the request entry to ack)."""
    return Publication(rid, OutputChunk(index, [100 + index], f"t{index} "),
                       FinalEntry("length", index + 1, 3), ack=ack)


def spans(items: list[Publication]) -> list[tuple[str, int, int, bool]]:
    """(request, first index, tokens, whether it ends the request) of each publication."""
    return [(p.request_id, p.chunk.index if p.chunk else -1,
             len(p.chunk.token_ids) if p.chunk else 0, p.final is not None) for p in items]


def test_interval_one_passes_everything_through_as_it_is():
    holder = ChunkHolder(1)
    items = [step("a", 0), step("a", 1)]
    assert holder.release(items) is items


@pytest.mark.parametrize("interval", [0, -2])
def test_an_interval_below_one_is_refused(interval):
    with pytest.raises(ValueError, match="stream interval"):
        ChunkHolder(interval)
    with pytest.raises(ValueError, match="stream_interval"):
        WorkerConfig(model_dir="m", stream_interval=interval)


def test_first_token_at_once_then_every_interval_tokens_and_the_final_takes_the_rest():
    holder = ChunkHolder(3)
    out = []
    for i in range(8):  # tokens 0..7 in eight steps, then the final with token 8
        out += holder.release([step("a", i)])
    out += holder.release([final("a", 8)])
    assert spans(out) == [("a", 0, 1, False), ("a", 1, 3, False), ("a", 4, 3, False),
                          ("a", 7, 2, True)]
    assert [t for p in out for t in p.chunk.token_ids] == [100 + i for i in range(9)]
    assert "".join(p.chunk.text for p in out) == "".join(f"t{i} " for i in range(9))
    # Entry ids are token indexes: each chunk's is past the one before.
    ids = [int(p.chunk.entry_id.split("-")[0]) for p in out]
    assert ids == sorted(ids) and ids[-1] == 9
    assert out[-1].ack == ("stream", "1-0") and holder.held_requests == 0


def test_logprobs_are_joined_with_their_tokens():
    holder = ChunkHolder(2)
    out = holder.release([step("a", 0, logprobs=True)])
    out += holder.release([step("a", 1, logprobs=True)])
    out += holder.release([step("a", 2, logprobs=True)])
    assert spans(out) == [("a", 0, 1, False), ("a", 1, 2, False)]
    assert [lp[1][0][0] for lp in out[1].chunk.logprobs] == [101, 102]


def test_a_request_a_step_leaves_out_gets_its_held_tokens_at_once():
    holder = ChunkHolder(4)
    holder.release([step("a", 0), step("b", 0)])  # both first tokens go out
    assert spans(holder.release([step("a", 1), step("b", 1)])) == []
    assert holder.held_requests == 2
    # "b" is not in this step (preempted, say): its token 1 goes now, "a"'s stays held.
    assert spans(holder.release([step("a", 2)])) == [("b", 1, 1, False)]
    # Output with no step in it says nothing of who runs: nothing leaves.
    assert holder.release([]) == [] and holder.held_requests == 1
    # Idle (no batch for a while) or closing: everything leaves.
    assert spans(holder.release([], flush_all=True)) == [("a", 1, 2, False)]
    assert holder.held_requests == 0


def test_with_an_interval_a_request_a_step_leaves_out_waits_for_its_interval():
    # A request that stalls (preempted, waiting for KV blocks) is not written a chunk each
    # time it does: at most one an interval, as when it runs.
    clock = ManualClock()
    holder = ChunkHolder(interval_s=0.05, clock=clock)
    holder.release([step("a", 0), step("b", 0)])  # both first tokens go out
    clock.advance(0.01)
    assert spans(holder.release([step("a", 1), step("b", 1)])) == []
    clock.advance(0.01)
    assert spans(holder.release([step("a", 2)])) == []  # "b" left out: still held
    clock.advance(0.03)  # both intervals over: "b" goes though this step leaves it out
    assert spans(holder.release([step("a", 3)])) == [("a", 1, 3, False), ("b", 1, 1, False)]
    assert holder.held_requests == 0


def test_a_request_that_ended_here_without_a_final_gets_its_held_tokens_written():
    holder = ChunkHolder(4)
    holder.release([step("a", 0)])
    holder.release([step("a", 1)])
    # Cancelled or its lease lost: what it produced is written, as with an interval of 1.
    assert spans(holder.release([step("a", 2)], ended={"a"})) == [("a", 1, 2, False)]
    # The same id served again later (claimed back): its first token goes at once again.
    assert spans(holder.release([step("a", 0)])) == [("a", 0, 1, False)]


def test_other_output_of_a_request_goes_after_its_held_tokens():
    from worker.fleet.publishing.publisher import Rejection

    holder = ChunkHolder(4)
    holder.release([step("a", 0)])
    holder.release([step("a", 1)])
    rejection = Rejection("stream", "1-0", "bad", request_id="a", write_final=False)
    out = holder.release([rejection, step("b", 0)])
    assert out[0].request_id == "a" and out[0].chunk.token_ids == [101]
    assert out[1] is rejection


def test_the_publisher_writes_chunks_of_the_interval_to_redis(redis_client):
    publisher = Publisher(redis_client, KEYS, "w-interval", 600,
                          TextStage(None, lambda rid: None), stream_interval=3,
                          clock=ManualClock())
    for i in range(6):
        publisher.publish([step("r-int", i)])
        publisher.tick()
    publisher.publish([final("r-int", 6, ack=None)])
    publisher.tick()
    entries = redis_client.xrange(KEYS.output("r-int"))
    # Token 0 alone, tokens 1-3, then 4-5 joined to the final's token 6.
    assert [e[0].decode() for e in entries] == ["1-0", "4-0", "7-0", "7-1"]


def written_tokens(r, rid: str) -> list[tuple[int, list[int], str]]:
    """(index, tokens, text) of each chunk on ``rid``'s stream, in order."""
    out = []
    for _, fields in r.xrange(KEYS.output(rid)):
        message = msgpack.unpackb(fields[FIELD])
        if message["kind"] == "chunk":
            out.append((message["index"], message["token_ids"], message["text"]))
    return out


def writer(redis_client, name: str, interval: int, rid: str, start: int, end: int,
           id_base: int = 0):
    """A worker's publisher and what it writes of ``rid``'s tokens ``start`` to ``end``
    (its first chunk alone, then joined in runs of ``interval``), one write at a time."""
    # The holder joins the chunks here, so that the writes can be interleaved one by one.
    publisher = Publisher(redis_client, KEYS, name, 600, TextStage(None, lambda r: None),
                          clock=ManualClock())
    holder = ChunkHolder(interval)
    batches = [holder.release([step(rid, i, id_base=id_base)]) for i in range(start, end)]
    batches.append(holder.release([], flush_all=True))
    return publisher, [b for b in batches if b]


@pytest.mark.parametrize("seed", range(40))
def test_two_writers_joining_different_runs_write_every_index_once(redis_client, seed):
    """A worker that lost its lease and the one that claimed the request (and took its
    stream over) both write it, their joined chunks ending at different places, in any
    interleaving: each token index is on the stream once, in order, and the text is whole."""
    rng = random.Random(seed)
    rid = f"r-fence-{seed}"
    total = 20
    resumed_at = rng.randrange(1, 12)
    old, old_writes = writer(redis_client, "w-old", rng.choice([2, 3, 4]), rid, 0, total)
    # The old worker writes until the stream holds resumed_at tokens or more; then the new
    # owner takes the stream over and resumes after what it holds, in the next ids.
    while sum(len(t) for _, t, _ in written_tokens(redis_client, rid)) < resumed_at:
        old.publish(old_writes.pop(0))
        old.tick()
    published = take_over(redis_client, KEYS, rid, 600)
    assert published.id_base == ID_GENERATION
    new, new_writes = writer(redis_client, "w-new", rng.choice([2, 3, 5]), rid,
                             len(published.token_ids), total, published.id_base)
    queues = [(old, old_writes), (new, new_writes)]
    while any(w for _, w in queues):
        pub, writes = rng.choice([q for q in queues if q[1]])
        pub.publish(writes.pop(0))
        pub.tick()
    chunks = written_tokens(redis_client, rid)
    indexes = [c[0] + k for c in chunks for k in range(len(c[1]))]
    assert indexes == list(range(total))
    assert [t for c in chunks for t in c[1]] == [100 + i for i in range(total)]
    assert "".join(c[2] for c in chunks) == "".join(f"t{i} " for i in range(total))


def test_a_stale_writers_joined_chunk_after_a_take_over_lands_nowhere(redis_client):
    """Precondition: without a take-over, a joined chunk ending past the stream's top lands
    over tokens the stream has (its id says only where it ends). After one, every id the
    stale writer sends is refused, its final too, and it acknowledges nothing."""
    key = KEYS.output("r-stale")
    redis_client.xadd(key, {FIELD: OutputChunk(0, [100, 101], "t0 t1 ").encode()}, id="2-0")
    stale = Publisher(redis_client, KEYS, "w-stale", 600, TextStage(None, lambda r: None),
                      clock=ManualClock())
    overlapping = Publication("r-stale", OutputChunk(1, [101, 102, 103], "t1 t2 t3 "))
    probe = "r-stale-probe"
    redis_client.xadd(KEYS.output(probe), {FIELD: b"x"}, id="2-0")
    stale.publish([replace(overlapping, request_id=probe)])
    stale.tick()
    assert [e[0] for e in redis_client.xrange(KEYS.output(probe))] == [b"2-0", b"4-0"]

    lane = KEYS.requests("m", "interactive")
    entry = redis_client.xadd(lane, {"m": b"r-stale"}).decode()
    redis_client.xgroup_create(lane, "workers", id="0")
    redis_client.xreadgroup("workers", "w-new", {lane: ">"})  # claimed by the new worker
    published = take_over(redis_client, KEYS, "r-stale", 600)
    assert published.token_ids == [100, 101] and published.id_base == ID_GENERATION
    stale.publish([overlapping, Publication("r-stale", OutputChunk(4, [104]),
                                            FinalEntry("length", 5), ack=(lane, entry))])
    stale.tick()  # refused as written (below the top): nothing lands, nothing is acked
    stale.tick()  # (where it owed an acknowledgement, this tick would send it)
    assert [e[0] for e in redis_client.xrange(key)] == [b"2-0"]
    assert redis_client.xpending(lane, "workers")["pending"] == 1  # still the new worker's
    new = Publisher(redis_client, KEYS, "w-new", 600, TextStage(None, lambda r: None),
                    clock=ManualClock())
    new.publish([Publication("r-stale", OutputChunk(2, [102, 103], id_base=ID_GENERATION),
                             FinalEntry("length", 4, id_base=ID_GENERATION))])
    new.tick()
    assert [(i, t) for i, t, _ in written_tokens(redis_client, "r-stale")] == [
        (0, [100, 101]), (2, [102, 103])]
    assert redis_client.xrevrange(key, count=1)[0][0] == f"{ID_GENERATION + 4}-1".encode()


@pytest.mark.parametrize("version", REDIS_VERSIONS)
def test_a_take_over_behaves_alike_on_each_redis(tmp_path, version):
    """TAKE_OVER on Redis 6.2 and 7: a stream not made yet is made empty in the next
    generation, with the TTL, and refuses a first chunk still on its way; a take-over of one
    that ends in a final, and a second take-over with nothing written since, each move it
    one generation further; the tokens an id counts stay."""
    with start_ephemeral(tmp_path, binary=redis_binary(version), appendonly="no") as server:
        r = redis.Redis.from_url(server.url)
        key = KEYS.output("v")
        assert take_over(r, KEYS, "v", 600) == Published(id_base=ID_GENERATION)
        assert r.xlen(key) == 0 and 0 < r.ttl(key) <= 600
        assert r.xinfo_stream(key)["last-generated-id"] == f"{ID_GENERATION}-0".encode()
        with pytest.raises(redis.ResponseError, match="equal or smaller"):
            r.xadd(key, {FIELD: step("v", 0).chunk.encode()}, id="1-0")
        chunk = OutputChunk(0, [100, 101], "t0 t1 ", id_base=ID_GENERATION)
        r.xadd(key, {FIELD: chunk.encode()}, id=chunk.entry_id)
        end = FinalEntry("length", 2, id_base=ID_GENERATION)
        r.xadd(key, {FIELD: end.encode()}, id=end.entry_id)
        second = take_over(r, KEYS, "v", 600)
        assert second == Published([100, 101], "t0 t1 ", finished=True,
                                   id_base=2 * ID_GENERATION)
        assert take_over(r, KEYS, "v", 600).id_base == 3 * ID_GENERATION
        last = r.xinfo_stream(key)["last-generated-id"]
        assert last == f"{3 * ID_GENERATION + 2}-0".encode()
        r.persist(key)
        take_over(r, KEYS, "v", 600)
        assert r.ttl(key) == -1  # a stream that was there: its TTL is its writers' to set


def test_a_refused_joined_chunk_and_its_final_land_together_on_the_retry(redis_client):
    """Redis out of memory (noeviction): the joined chunk and the final after it are both
    refused (the final is in the same script), nothing is acknowledged, and the retry
    writes both, once."""
    publisher = Publisher(redis_client, KEYS, "w-full", 600, TextStage(None, lambda r: None),
                          stream_interval=3, clock=ManualClock())
    publisher.publish([step("r-full", 0)])
    publisher.tick()
    for i in (1, 2):
        publisher.publish([step("r-full", i)])
        publisher.tick()
    assert publisher.holder.held_requests == 1
    refusals = int(redis_client.info("errorstats").get("errorstat_OOM", {}).get("count", 0))
    redis_client.config_set("maxmemory", "1")
    try:
        publisher.publish([final("r-full", 3, ack=None)])
        with pytest.raises(WriteRefused, match="maxmemory"):
            publisher.tick()
        # Refused for memory, as meant, and said as an OOM on Redis 6.2 as on 7.
        assert int(redis_client.info("errorstats")["errorstat_OOM"]["count"]) > refusals
        assert [e[0] for e in redis_client.xrange(KEYS.output("r-full"))] == [b"1-0"]
    finally:
        redis_client.config_set("maxmemory", "0")
    publisher.tick()  # the owed batch, as the supervisor's retry runs it
    assert [e[0] for e in redis_client.xrange(KEYS.output("r-full"))] == [
        b"1-0", b"4-0", b"4-1"]


def test_a_cancels_final_takes_the_held_tokens_with_it():
    holder = ChunkHolder(4)
    holder.release([step("c", 0)])
    holder.release([step("c", 1)])
    cancelled = Publication("c", None, FinalEntry("cancelled", 2, 3))
    (out,) = holder.release([cancelled])
    assert out.final is cancelled.final and out.chunk.token_ids == [101]
    assert holder.held_requests == 0


def test_several_steps_in_one_batch_give_one_joined_chunk_after_the_rest():
    """A batch of several steps (the publisher behind): per request at most one joined
    chunk, last of its output; what must go before other output goes step by step."""
    from worker.fleet.publishing.publisher import Rejection

    holder = ChunkHolder(2)
    holder.release([step("a", 0)])
    out = holder.release([step("a", 1), step("a", 2), step("a", 3), step("a", 4)])
    assert spans(out) == [("a", 1, 4, False)]
    holder.release([step("a", 5)])  # held
    rejection = Rejection("s", "1-0", "duplicate id", request_id="a", write_final=False)
    out = holder.release([step("a", 6), rejection, step("a", 7), final("a", 8)])
    # Tokens 5 and 6 one by one before the rejection, then 7 joined to the final's 8.
    assert [(p.request_id, p.chunk.index if getattr(p, "chunk", None) else None)
            for p in out] == [("a", 5), ("a", 6), ("a", None), ("a", 7)]
    assert out[2] is rejection and out[3].final is not None
    assert out[3].chunk.token_ids == [107, 108]


def test_close_writes_what_is_held(redis_client):
    publisher = Publisher(redis_client, KEYS, "w-interval-close", 600,
                          TextStage(None, lambda rid: None), stream_interval=8,
                          clock=SystemClock())
    publisher.start()
    publisher.publish([step("r-close", 0)])
    publisher.publish([step("r-close", 1)])
    publisher.publish([step("r-close", 2)])
    assert publisher.close(timeout=30)
    ids = [e[0].decode() for e in redis_client.xrange(KEYS.output("r-close"))]
    assert ids == ["1-0", "3-0"]


def test_a_worker_with_an_interval_gives_the_offline_engines_results(redis_url, tiny_llama,
                                                                     start_worker):
    start_worker(config={"stream_interval": 4})
    client = Client(redis_url)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 1000) for _ in range(n)] for n in (5, 30)]
    sampling = dict(max_tokens=11, temperature=0, ignore_eos=True)
    ids = [client.submit(p, model=MODEL, **sampling) for p in prompts]
    streams = [list(client.stream(rid, timeout=60)) for rid in ids]
    offline = Engine(tiny_llama, dtype="float64", num_kv_blocks=512)
    want = offline.generate(prompts, SamplingParams(**sampling))
    for events, expected in zip(streams, want, strict=True):
        chunks, end = events[:-1], events[-1]
        assert [t for c in chunks for t in c.token_ids] == expected.token_ids
        assert "".join(c.text for c in chunks) == expected.text
        assert end.num_tokens == 11
        # The first token alone, then joined chunks. Their sizes depend on the machine's
        # pace: a publisher behind by several steps writes all it has in one chunk (larger
        # than the interval), and one that waits 0.5 s for a step writes what it holds
        # (smaller); the holder's own tests pin both down.
        assert len(chunks[0].token_ids) == 1
        assert len(chunks) < 11
    assert settled_pending(client.redis) == 0


# --- by time: --stream-interval-ms (the default) -------------------------------------------


def test_a_requests_tokens_go_out_at_most_once_an_interval():
    clock = ManualClock()
    holder = ChunkHolder(interval_s=0.05, clock=clock)
    out = holder.release([step("a", 0)])  # the first token: at once
    for i in (1, 2, 3):
        clock.advance(0.015)
        out += holder.release([step("a", i)])
    assert spans(out) == [("a", 0, 1, False)] and holder.held_requests == 1
    assert holder.next_due() == pytest.approx(0.005)
    clock.advance(0.005)  # 50 ms after the first chunk went out
    out += holder.release([step("a", 4)])
    assert spans(out)[1:] == [("a", 1, 4, False)]
    clock.advance(0.01)
    out += holder.release([final("a", 5)])  # the final: at once, with what was held
    assert spans(out)[2:] == [("a", 5, 1, True)]
    assert [t for p in out for t in p.chunk.token_ids] == [100 + i for i in range(6)]
    assert holder.held_requests == 0 and holder.next_due() is None


def test_tokens_slower_than_the_interval_go_out_one_by_one_at_once():
    clock = ManualClock()
    holder = ChunkHolder(interval_s=0.05, clock=clock)
    out = []
    for i in range(5):
        out += holder.release([step("a", i)])
        clock.advance(0.06)
    assert spans(out) == [("a", i, 1, False) for i in range(5)]


def test_held_tokens_go_out_when_due_even_without_another_step():
    clock = ManualClock()
    holder = ChunkHolder(interval_s=0.05, clock=clock)
    holder.release([step("a", 0), step("b", 0)])
    clock.advance(0.02)
    assert holder.release([step("a", 1), step("b", 1)]) == []
    assert holder.release([]) == []  # not due yet
    clock.advance(0.03)
    # The engine stalled (no step): their interval is over, so they go.
    assert sorted(spans(holder.release([]))) == [("a", 1, 1, False), ("b", 1, 1, False)]


def test_the_worker_default_is_fifty_milliseconds_and_zero_passes_everything():
    assert WorkerConfig(model_dir="m").stream_interval_ms == 50
    holder = ChunkHolder(interval_s=0)
    items = [step("a", 0), step("a", 1)]
    assert holder.release(items) is items
    with pytest.raises(ValueError, match="stream_interval_ms"):
        WorkerConfig(model_dir="m", stream_interval_ms=-1)


def test_a_worker_at_the_default_interval_streams_exactly_and_resumes_from_any_entry(
        redis_url, tiny_llama, start_worker):
    start_worker()  # the default: --stream-interval-ms 50
    client = Client(redis_url)
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 1000) for _ in range(n)] for n in (5, 30, 12)]
    sampling = dict(max_tokens=40, temperature=0, ignore_eos=True)
    ids = [client.submit(p, model=MODEL, **sampling) for p in prompts]
    want = Engine(tiny_llama, dtype="float64", num_kv_blocks=512).generate(
        prompts, SamplingParams(**sampling))
    for rid, expected in zip(ids, want, strict=True):
        events = list(client.stream(rid, timeout=60))
        assert [t for e in events[:-1] for t in e.token_ids] == expected.token_ids
        entries = client.redis.xrange(KEYS.output(rid))
        assert len(entries) - 1 < len(expected.token_ids)  # coalesced: fewer chunks than tokens
        # Resumed after any entry, a reader gets exactly the tokens after it, each once.
        seen = 0
        for entry_id, _ in entries[:-1]:
            seen += len(OutputChunkOf(entries, entry_id))
            rest = [t for e in client.stream(rid, entry_id.decode(), timeout=60)
                    for t in getattr(e, "token_ids", [])]
            assert rest == expected.token_ids[seen:]
    assert settled_pending(client.redis) == 0


def OutputChunkOf(entries, entry_id) -> list[int]:  # noqa: N802 - reads like the type
    """The token ids of the chunk at ``entry_id``."""
    [fields] = [f for e, f in entries if e == entry_id]
    return msgpack.unpackb(fields[FIELD.encode() if isinstance(FIELD, str) else FIELD])[
        "token_ids"]


def test_the_publisher_counts_chunks_tokens_and_its_lag(redis_client):
    """What /metrics shows of the wire: chunks per token, and tokens made but not in Redis
    yet (queued, or held by the interval)."""
    clock = ManualClock()
    publisher = Publisher(redis_client, KEYS, "w-counts", 600, TextStage(None, lambda r: None),
                          stream_interval_ms=50, clock=clock)
    trips: list[float] = []
    publisher.on_round_trip = trips.append
    for i in range(4):
        publisher.publish([step("r-c", i)])
    assert publisher.lag_tokens == 4  # queued
    publisher.tick()  # token 0 at once; 1-3 held (no time passed)
    assert (publisher.tokens_written, publisher.chunks_written, publisher.lag_tokens) == (1, 1, 3)
    clock.advance(0.05)
    publisher.tick()  # due: one joined chunk
    assert (publisher.tokens_written, publisher.chunks_written, publisher.lag_tokens) == (4, 2, 0)
    assert len(trips) == 2 and all(t >= 0 for t in trips)


def test_the_publisher_times_a_batch_from_handed_over_to_in_redis(redis_client):
    """``on_published`` (the worker's conveyor_publish_delay_seconds): from the engine loop
    handing a step's output over to its entries in Redis, on the publisher's clock, once a
    batch; the oldest step of a batch that took several; a retried batch from its first
    hand-over; not a stream interval's hold (a release by time alone hands nothing over)."""
    clock = ManualClock()
    publisher = Publisher(redis_client, KEYS, "w-delay", 600, TextStage(None, lambda r: None),
                          stream_interval_ms=50, clock=clock)
    delays: list[float] = []
    publisher.on_published = delays.append
    publisher.publish([step("r-d", 0)])
    clock.advance(0.004)
    publisher.publish([step("r-d", 1)])  # two steps wait: one batch, timed from the first
    clock.advance(0.002)
    publisher.tick()  # token 0 written at once, token 1 held
    assert delays == [pytest.approx(0.006)]
    clock.advance(0.05)
    publisher.tick()  # the held token leaves by time: nothing handed over, nothing timed
    assert publisher.tokens_written == 2 and delays == [pytest.approx(0.006)]
    # A batch Redis did not take is timed once it is in, from its first hand-over.
    reachable = publisher.client
    publisher.client = unreachable = connect("redis://127.0.0.1:1/0", retry_attempts=0)
    publisher.publish([step("r-e", 0)])
    clock.advance(0.01)
    with pytest.raises(redis.ConnectionError):
        publisher.tick()
    assert delays == [pytest.approx(0.006)] and publisher.tokens_written == 2  # not in yet
    publisher.client = reachable
    clock.advance(0.02)
    publisher.tick()  # the retry (the supervisor's, after its backoff)
    assert publisher.tokens_written == 3 and delays[1:] == [pytest.approx(0.03)]
    unreachable.close()
    # A batch that writes no entry (a request's prompt blocks for the KV tier) is not timed.
    publisher.publish([SharePrefix("r-f", [(b"h", b"kv")])])
    publisher.tick()
    assert len(delays) == 2


# --- held by the engine loop: requests whose text needs no look at every token -------------


def test_the_engine_loop_holds_a_requests_tokens_for_the_interval():
    """TokenHold: the first token and the final at once, then at most a chunk an interval,
    the held tokens first; a request a step leaves out releases what it holds once its
    interval is over, not before; one that does not coalesce (stop strings,
    log-probabilities) is never held."""
    hold = TokenHold(0.05)
    entry = InflightRequest("a", "lane", "1-0", 3, coalesce=True)
    plain = InflightRequest("p", "lane", "2-0", 3)

    def step(at: float, *gains: tuple[InflightRequest, int]) -> list:
        taken = [hold.take(e, [token], at, finished=False) for e, token in gains]
        assert hold.due(at) == []  # (what a step holds at its time is never due then)
        return taken

    assert step(0.0, (entry, 10), (plain, 20)) == [[10], [20]]  # first tokens: at once
    assert step(0.01, (entry, 11), (plain, 21)) == [None, [21]]  # held; never held
    assert step(0.02, (entry, 12)) == [None] and hold.tokens == 2
    assert step(0.05, (entry, 13)) == [[11, 12, 13]] and hold.tokens == 0  # interval over
    assert step(0.06, (entry, 14)) == [None]
    # A step without it (preempted, waiting for blocks): it stays held...
    assert hold.due(0.07) == [] and hold.tokens == 1
    # ... until a step after its interval, which goes without it too.
    assert hold.due(0.1) == [(entry, [14])] and hold.tokens == 0
    assert step(0.11, (entry, 15)) == [None]
    assert hold.take(entry, [16], 0.12, finished=True) == [15, 16]  # the final: with it all
    assert hold.release_all(0.13) == []


def test_a_handed_on_request_goes_on_in_the_generation_its_prefill_worker_wrote(redis_client):
    """A prefill worker that took a request over wrote its first token in the next
    generation; the decode worker reads what it published (no take-over of its own: the
    prefill worker writes nothing after the hand-on) and writes in that generation."""
    key = KEYS.output("r-handed")
    assert read_published(redis_client, KEYS, "r-handed").id_base == 0  # nothing yet
    taken = take_over(redis_client, KEYS, "r-handed", 600)
    first = OutputChunk(0, [100], "t0 ", id_base=taken.id_base)
    redis_client.xadd(key, {FIELD: first.encode()}, id=first.entry_id)
    published = read_published(redis_client, KEYS, "r-handed")
    assert published.token_ids == [100] and published.id_base == ID_GENERATION
    after = OutputChunk(1, [101], "t1 ", id_base=published.id_base)
    redis_client.xadd(key, {FIELD: after.encode()}, id=after.entry_id)  # lands: above it
    assert [i for i, _, _ in written_tokens(redis_client, "r-handed")] == [0, 1]
