"""What the publisher sends Redis for a step: one XADD for a decoding request, the stream's TTL
renewed only when less than the full TTL is left, several commands of one key in one
MULTI/EXEC; and the TTL guarantee holds throughout: a stream outlives its last write by the
TTL, and lives exactly the TTL past its final."""

from __future__ import annotations

import pytest
import redis

from producer.clock import ManualClock
from producer.wire.keys import Keys
from producer.wire.protocol import FinalEntry, OutputChunk
from worker.fleet.config import WorkerConfig
from worker.fleet.inflight import InflightRequest, InflightTable
from worker.fleet.publishing import publisher as publisher_module
from worker.fleet.publishing.publisher import Publication, Publisher
from worker.fleet.publishing.text_stage import Forget, TextStage

KEYS = Keys()
TTL_S = 800  # renewed to TTL + TTL / 8 = 900 s once less than 850 s are left


def calls(r: redis.Redis, command: str) -> int:
    return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


class Counts:
    """Calls of the commands a step may send, since the last look."""

    NAMES = ("xadd", "expire", "multi", "exec")

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.last = {n: calls(r, n) for n in self.NAMES}

    def since(self) -> dict[str, int]:
        now = {n: calls(self.r, n) for n in self.NAMES}
        diff = {n: now[n] - self.last[n] for n in self.NAMES}
        self.last = now
        return {n: d for n, d in diff.items() if d}


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def publisher(redis_client, clock) -> Publisher:
    return Publisher(redis_client, KEYS, "w-commands", TTL_S, TextStage(None, lambda rid: None),
                     clock=clock)


def publish(pub: Publisher, *items) -> None:
    """What one engine step hands over, written as the publisher thread writes it."""
    pub.publish(list(items))
    pub.tick()
    assert pub._owed is None  # written, not left owed to a retry


def chunk(rid: str, index: int) -> Publication:
    return Publication(rid, OutputChunk(index, [100 + index]))


def test_a_decoding_stream_costs_one_xadd_a_step_and_its_ttl_is_renewed_when_due(
        redis_client, publisher, clock):
    key = KEYS.output("r1")
    counts = Counts(redis_client)
    slack = publisher.ttl_renew_slack_s
    assert slack == TTL_S // 8

    # The stream's first write sets its TTL, past the TTL; no transaction (an EXPIRE beside
    # a refused XADD only renews a TTL).
    publish(publisher, chunk("r1", 0))
    assert counts.since() == {"xadd": 1, "expire": 1}
    assert TTL_S < redis_client.ttl(key) <= TTL_S + slack

    for i in range(1, 4):  # more than TTL + slack / 2 left: the XADD alone, no transaction
        clock.advance(slack / 8)
        publish(publisher, chunk("r1", i))
        assert counts.since() == {"xadd": 1}
    clock.advance(slack / 8 + 1)  # now less is left: renewed with the next write
    publish(publisher, chunk("r1", 4))
    assert counts.since() == {"xadd": 1, "expire": 1}
    assert TTL_S < redis_client.ttl(key) <= TTL_S + slack

    publish(publisher, Publication("r1", OutputChunk(5, [7]),
                                   FinalEntry("length", 6, {"completion_tokens": 6})))
    assert counts.since() == {"xadd": 2, "expire": 1, "multi": 1, "exec": 1}
    assert TTL_S - 5 <= redis_client.ttl(key) <= TTL_S  # exactly the TTL past its end
    assert redis_client.xlen(key) == 7
    assert "r1" not in publisher._lives_until  # ended: nothing kept for it


def test_many_requests_in_one_step_cost_one_command_each(redis_client, publisher, clock):
    rids = [f"m{i}" for i in range(16)]
    counts = Counts(redis_client)
    publish(publisher, *(chunk(rid, 0) for rid in rids))
    assert counts.since() == {"xadd": 16, "expire": 16}
    publish(publisher, *(chunk(rid, 1) for rid in rids))
    assert counts.since() == {"xadd": 16}
    assert all(redis_client.xlen(KEYS.output(rid)) == 2 for rid in rids)
    assert all(redis_client.ttl(KEYS.output(rid)) > TTL_S for rid in rids)


def test_a_stream_forgotten_here_is_renewed_again_if_it_comes_back(
        redis_client, publisher, clock):
    # Handed to another worker (Forget), then back: its TTL is not this publisher's to trust.
    publish(publisher, chunk("r2", 0))
    publish(publisher, Forget("r2"))
    assert "r2" not in publisher._lives_until
    redis_client.persist(KEYS.output("r2"))  # as if another writer had left it without one
    counts = Counts(redis_client)
    publish(publisher, chunk("r2", 1))
    assert counts.since()["expire"] == 1
    assert redis_client.ttl(KEYS.output("r2")) > TTL_S


def test_a_request_handed_on_leaves_no_ttl_behind(redis_client, publisher, clock):
    """A prefill worker publishes a request's first chunk and forgets it in one batch."""
    publish(publisher, chunk("h1", 0), Forget("h1"))
    assert redis_client.ttl(KEYS.output("h1")) > TTL_S  # the chunk's write renewed it
    assert "h1" not in publisher._lives_until


def test_entries_of_streams_no_longer_written_are_pruned(redis_client, publisher, clock,
                                                         monkeypatch):
    monkeypatch.setattr("worker.fleet.publishing.publisher.PRUNE_EVERY_BATCHES", 1)
    publish(publisher, chunk("p1", 0))
    assert "p1" in publisher._lives_until
    clock.advance(publisher.ttl_renew_slack_s)  # due for renewal: the entry is worth nothing
    publish(publisher, chunk("p2", 0))
    assert set(publisher._lives_until) == {"p2"}


def test_a_refused_renewal_is_not_taken_for_done(redis_client, publisher, clock):
    """Redis refusing the first write (out of memory) leaves no renewal recorded: the retry
    sends the EXPIRE again with the XADD."""
    redis_client.config_set("maxmemory", "1")
    try:
        publisher.publish([chunk("r3", 0)])
        with pytest.raises(redis.ResponseError):
            publisher.tick()
        assert publisher._owed and "r3" not in publisher._lives_until  # refused, owed
    finally:
        redis_client.config_set("maxmemory", "0")
    counts = Counts(redis_client)
    publisher.tick()  # the supervisor's retry
    assert publisher._owed is None
    assert counts.since() == {"xadd": 1, "expire": 1}
    assert redis_client.ttl(KEYS.output("r3")) > TTL_S


def test_output_stream_names_are_kept_a_while_then_forgotten(redis_client, publisher,
                                                             monkeypatch):
    """The publisher names each request's stream once, not every step, and forgets the names
    it keeps once there are MAX_CACHED_KEYS of them; every entry still reaches its stream."""
    monkeypatch.setattr("worker.fleet.publishing.publisher.MAX_CACHED_KEYS", 2)
    publish(publisher, chunk("k1", 0), chunk("k2", 0))
    assert publisher._output_keys == {"k1": KEYS.output("k1"), "k2": KEYS.output("k2")}
    publish(publisher, chunk("k3", 0))
    assert publisher._output_keys == {"k3": KEYS.output("k3")}
    publish(publisher, chunk("k1", 1), chunk("k3", 1))
    assert [redis_client.xlen(KEYS.output(r)) for r in ("k1", "k2", "k3")] == [2, 1, 2]


# Commands a request costs the publisher besides its chunks' XADDs (docs/redis.md): its
# final's XADD, an EXPIRE with its first write and one with its final, the MULTI and EXEC
# that make its last chunk and its final one write, and a share of one XACK for every
# request stream and batch of finals (sent with the next batch, or alone once ACK_DELAY_S
# passed).
COMMANDS_BESIDES_CHUNKS = 6


def test_a_request_costs_its_chunks_and_at_most_k_commands_more(redis_client):
    """Counted with Redis's own counters (calls inside scripts included): 8 requests of 40
    tokens at a step every 10 ms, written at most every 50 ms."""
    clock = ManualClock()
    pub = Publisher(redis_client, KEYS, "w-budget", TTL_S, TextStage(None, lambda r: None),
                    stream_interval_ms=50, clock=clock)
    lane = KEYS.requests("m", "batch")
    rids = [f"b{i}" for i in range(8)]
    entries = {rid: redis_client.xadd(lane, {"m": rid}).decode() for rid in rids}
    redis_client.xgroup_create(lane, "workers", id="0")
    redis_client.xreadgroup("workers", "w-budget", {lane: ">"})  # this worker owns them
    redis_client.config_resetstat()
    for i in range(39):
        publish(pub, *(chunk(rid, i) for rid in rids))
        clock.advance(0.01)
    publish(pub, *(Publication(rid, OutputChunk(39, [139]), FinalEntry("length", 40, {}),
                               ack=(lane, entries[rid])) for rid in rids))
    stats = {k.removeprefix("cmdstat_"): int(v["calls"])
             for k, v in redis_client.info("commandstats").items()}
    chunks = sum(redis_client.xlen(KEYS.output(rid)) - 1 for rid in rids)
    assert chunks < 8 * 40 / 4  # coalesced: a chunk carries several tokens
    # A chunk is one XADD, joined or not: no script, no read of the stream's top.
    assert stats["xadd"] == chunks + len(rids)  # every chunk, and every final, once
    assert "xrevrange" not in stats
    besides = sum(stats.values()) - chunks - stats.get("config", 0)
    # One transaction a request: its last chunk and its final (each key's other batches
    # hold one write, and need none).
    assert stats["multi"] == stats["exec"] == len(rids)
    assert stats["expire"] == 2 * len(rids)
    # The finals' acknowledgement waits for the next batch's round trip; none comes within
    # ACK_DELAY_S (a wait on the queue): it goes alone, one XACK for the batch's finals.
    assert "xack" not in stats and redis_client.xpending(lane, "workers")["pending"] == 8
    pub.tick()
    assert calls(redis_client, "xack") == 1 and "xpending" not in stats
    assert besides + 1 <= COMMANDS_BESIDES_CHUNKS * len(rids), stats
    assert redis_client.xpending(lane, "workers")["pending"] == 0


def test_acknowledgements_go_with_the_next_batch_and_any_left_at_close(
        redis_client, monkeypatch):
    """A batch's finals are acknowledged at the head of the next batch's round trip (no
    round trip of their own at a GPU's step rate); what is owed when the publisher closes
    goes before it stops."""
    trips: list[list[tuple]] = []
    real = publisher_module.run_commands
    monkeypatch.setattr(publisher_module, "run_commands",
                        lambda client, wire: trips.append(wire) or real(client, wire))
    clock = ManualClock()
    pub = Publisher(redis_client, KEYS, "w-acks", TTL_S, TextStage(None, lambda r: None),
                    clock=clock)
    lane = KEYS.requests("m", "batch")
    entries = {rid: redis_client.xadd(lane, {"m": rid}).decode() for rid in ("a", "b", "c")}
    redis_client.xgroup_create(lane, "workers", id="0")
    redis_client.xreadgroup("workers", "w-acks", {lane: ">"})

    def final(rid: str) -> Publication:
        return Publication(rid, OutputChunk(0, [7]), FinalEntry("length", 1, {}),
                           ack=(lane, entries[rid]))

    publish(pub, final("a"))
    assert redis_client.xlen(KEYS.output("a")) == 2  # its final is in Redis ...
    assert redis_client.xpending(lane, "workers")["pending"] == 3  # ... not yet acknowledged
    trips.clear()
    publish(pub, chunk("c", 0))  # the next step's round trip takes it, on the same clock
    assert redis_client.xpending(lane, "workers")["pending"] == 2
    assert len(trips) == 1 and trips[0][0] == ("XACK", lane, "workers", entries["a"])
    # A final that comes with the publisher's close is acknowledged before it stops.
    pub.publish([final("b")])
    pub.close(timeout=5)
    pub.run()  # (never started as a thread here) what close() queued, then stop
    pending = redis_client.xpending_range(lane, "workers", "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == [entries["c"]]


def test_a_full_worker_reads_new_requests_a_few_at_a_time():
    """The in-flight table has no room while fewer than ``read_batch`` places are free:
    with 4 seats and a prefetch of 8 (read_batch 4), the intake reads when 4 are free, not
    once for each request that ends; an empty table is all room."""
    table = InflightTable(4 + 8, read_batch=4)
    assert table.room() == 12
    for i in range(12):
        assert table.add([InflightRequest(f"r{i}", "lane", f"{i}-0", 3)])
    assert table.room() == 0
    for i in range(3):
        table.remove(f"r{i}")
        assert table.room() == 0  # 1, 2, 3 free: the 4 waiting beyond the seats go on
    table.remove("r3")
    assert table.room() == 4 and table.wait_for_room(timeout=0)
    assert InflightTable(2, read_batch=4).room() == 2  # never more than the table holds


def test_the_default_prefetch_is_a_sixteenth_of_the_seats(start_worker, tmp_path):
    """A GPU's batch of 256 ends ~200 requests a second: reading them 4 at a time would cost
    Redis a round trip or more a request. The default prefetch is a sixteenth of the seats
    (at least 8; 8 on a decode worker, whose waiting requests hold KV), and the intake
    reads once half of it is free; one given is kept."""
    assert WorkerConfig(model_dir=tmp_path).prefetch is None
    assert WorkerConfig(model_dir=tmp_path).prefetch_for(256) == 16
    assert WorkerConfig(model_dir=tmp_path).prefetch_for(64) == 8
    assert WorkerConfig(model_dir=tmp_path, role="decode").prefetch_for(256) == 8
    assert WorkerConfig(model_dir=tmp_path, prefetch=2).prefetch_for(256) == 2
    big = start_worker(prefetch=None, autostart=False, simulate_step_ms=1, max_num_seqs=256)
    assert (big.inflight.capacity, big.inflight.read_batch) == (256 + 16, 8)
