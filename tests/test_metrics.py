"""A worker's Prometheus endpoint, scraped over HTTP while it serves real requests."""

from __future__ import annotations

import time
import urllib.request

from fleet_fixtures import MODEL
from prometheus_client.parser import text_string_to_metric_families

from producer.client.client import Client
from producer.client.queues import lane_stats
from producer.clock import ManualClock
from producer.wire.keys import GROUP, Keys
from producer.wire.params import SamplingParams
from producer.wire.protocol import FIELD, GenerationRequest, OutputChunk

KEYS = Keys()


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} from the worker's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    want = {"model": MODEL, **labels}
    hits = [v for (n, ls), v in samples.items() if n == name and want.items() <= dict(ls).items()]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples"
    return hits[0]


def test_metrics_count_requests_tokens_and_latencies_of_served_requests(redis_url,
                                                                         start_worker):
    worker = start_worker(metrics_port=0)
    assert worker.metrics_port and worker.metrics_port > 0
    client = Client(redis_url)
    ids = [client.submit(list(range(10, 10 + n)), model=MODEL, max_tokens=8, temperature=0,
                         ignore_eos=True) for n in (5, 30)]
    ids.append(client.submit(list(range(10, 20)), model=MODEL, max_tokens=3, lane="batch",
                             temperature=0, ignore_eos=True))
    for rid in ids:
        assert client.result(rid, timeout=60).finish_reason == "length"

    s = scrape(worker.metrics_port)
    assert value(s, "conveyor_worker_info", worker_id="w0") == 1
    assert value(s, "conveyor_requests_finished_total", finish_reason="length") == 3
    assert value(s, "conveyor_requests_finished_total", finish_reason="error") == 0
    assert value(s, "conveyor_requests_admitted_total", lane="interactive") == 2
    assert value(s, "conveyor_requests_admitted_total", lane="batch") == 1
    assert value(s, "conveyor_prompt_tokens_total") == 5 + 30 + 10
    assert value(s, "conveyor_generation_tokens_total") == 8 + 8 + 3
    # One TTFT per request, one inter-token gap per later token.
    assert value(s, "conveyor_time_to_first_token_seconds_count") == 3
    assert value(s, "conveyor_inter_token_latency_seconds_count") == 7 + 7 + 2
    assert value(s, "conveyor_request_queue_wait_seconds_count") == 3
    assert value(s, "conveyor_e2e_request_latency_seconds_count") == 3
    # The publisher's batches: each that wrote entries timed from handed over to in Redis
    # (no longer than the requests took), each with its write round trip.
    published = value(s, "conveyor_publish_delay_seconds_count")
    assert published >= 1
    assert value(s, "conveyor_redis_write_seconds_count") >= published
    delays = value(s, "conveyor_publish_delay_seconds_sum")
    assert 0 <= delays <= value(s, "conveyor_e2e_request_latency_seconds_sum") * published
    ttft_sum = value(s, "conveyor_time_to_first_token_seconds_sum")
    assert 0 < ttft_sum <= value(s, "conveyor_e2e_request_latency_seconds_sum")
    # Every computed token was in a timed step.
    stats = worker.engine.stats()
    assert value(s, "conveyor_step_tokens_sum") == stats["computed_tokens"]
    timed_steps = value(s, "conveyor_step_duration_seconds_count")  # a count, not a time
    assert timed_steps == stats["steps"]
    assert value(s, "conveyor_engine_steps_total") == stats["steps"]
    # Engine gauges, read at scrape time: nothing left running.
    assert value(s, "conveyor_requests_running") == 0
    assert value(s, "conveyor_requests_waiting") == 0
    assert value(s, "conveyor_requests_swapped") == 0
    assert value(s, "conveyor_kv_blocks_total") == 512
    assert value(s, "conveyor_kv_pool_bytes") == worker.engine.memory.pool_bytes > 0
    # 512 blocks of 16 tokens: the tiny model's 2 layers x K and V x 2 KV heads x 16 wide,
    # float64.
    assert worker.engine.memory.pool_bytes == 512 * 16 * 2 * 2 * 2 * 16 * 8
    assert "conveyor_gpu_memory_utilization" not in s  # (a CPU's pool is not sized so)
    assert value(s, "conveyor_preemptions_total", mode="recompute") == 0
    assert value(s, "conveyor_preemptions_total", mode="swap") == 0


def test_a_taken_over_request_is_not_timed_again_and_refused_ones_count_as_errors(
        redis_url, redis_client, start_worker):
    """A request taken over after its first token went out (its worker died) has had its
    TTFT and queue wait: the worker that resumes it times neither again (it recorded ~30 s
    of each, a spike in the panels at every crash). A request the intake refuses (another
    model's) is answered error and counted finished{error}, as an engine's refusal is."""
    stream = KEYS.requests(MODEL, "interactive")
    redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    taken = GenerationRequest("taken-over", MODEL, params, prompt_token_ids=[5, 6, 7])
    redis_client.xadd(stream, {FIELD: taken.encode()})
    got = redis_client.xreadgroup(GROUP, "gone", {stream: ">"}, count=1)
    redis_client.xclaim(stream, GROUP, "gone", 0, [got[0][1][0][0]], idle=10 ** 6,
                        justid=True)  # (its worker died: the lease long lapsed)
    chunk = OutputChunk(0, [11, 12, 13], "")  # the three tokens it had published
    redis_client.xadd(KEYS.output("taken-over"), {FIELD: chunk.encode()}, id=chunk.entry_id)
    other = GenerationRequest("elsewhere", "other-model", params, prompt_token_ids=[5])
    redis_client.xadd(stream, {FIELD: other.encode()})
    worker = start_worker(metrics_port=0)
    client = Client(redis_url)
    assert client.result("taken-over", timeout=60).finish_reason == "length"
    assert client.result("elsewhere", timeout=60).finish_reason == "error"
    s = scrape(worker.metrics_port)
    assert value(s, "conveyor_requests_admitted_total", lane="interactive") == 1
    assert value(s, "conveyor_requests_finished_total", finish_reason="length") == 1
    assert value(s, "conveyor_requests_finished_total", finish_reason="error") == 1
    assert value(s, "conveyor_time_to_first_token_seconds_count") == 0
    assert value(s, "conveyor_request_queue_wait_seconds_count") == 0
    assert value(s, "conveyor_inter_token_latency_seconds_count") == 3  # (its own tokens)


def test_two_workers_in_one_process_have_separate_registries(redis_url, start_worker):
    a = start_worker("a", metrics_port=0)
    b = start_worker("b", metrics_port=0)
    assert a.metrics_port != b.metrics_port
    client = Client(redis_url)
    client.result(client.submit([5, 6, 7], model=MODEL, max_tokens=4, ignore_eos=True),
                  timeout=60)
    finished = [value(scrape(w.metrics_port), "conveyor_requests_finished_total",
                      finish_reason="length") for w in (a, b)]
    assert sorted(finished) == [0, 1]


def test_lane_gauges_follow_queued_and_pending_requests(redis_url, start_worker):
    clock = ManualClock()
    worker = start_worker(metrics_port=0, max_num_seqs=1, prefetch=1, clock=clock)
    worker.loop.pause()  # nothing finishes: the worker holds 2 (1 admitted, 1 prefetched)
    client = Client(redis_url)
    ids = [client.submit([1, 2, 3], model=MODEL, max_tokens=500, ignore_eos=True)
           for _ in range(6)]
    end = time.monotonic() + 30  # a bound on a wait for a state that is certain to come
    while len(worker.inflight) < 2:
        assert time.monotonic() < end, "the worker never read its two requests"
        time.sleep(0.01)
    # A poll that began after the state settled. Twice: the first poll to end may be one
    # that was already under way (the poller's first, at start-up, on a loaded machine);
    # the poller starts the next only after it, at the next interval.
    for _ in range(2):
        polls = worker.queue_poller.ticks
        clock.advance(worker.queue_poller.interval_s)
        while worker.queue_poller.ticks == polls:
            assert time.monotonic() < end, "the queue poller never polled"
            time.sleep(0.01)
    s = scrape(worker.metrics_port)
    depth = value(s, "conveyor_queue_depth", lane="interactive")
    pending = value(s, "conveyor_queue_pending", lane="interactive")
    assert (depth, pending) == (4, 2)
    assert value(s, "conveyor_queue_depth", lane="batch") == 0
    for rid in ids:
        client.cancel(rid)
    worker.loop.resume()
    for rid in ids:
        assert client.result(rid, timeout=60).finish_reason == "cancelled"


def test_lane_stats_count_undelivered_and_unacknowledged_entries(redis_client):
    interactive = KEYS.requests("m", "interactive")
    for i in range(5):
        redis_client.xadd(interactive, {"m": str(i)})
    # No consumer group yet: everything waits.
    assert [(s.lane, s.depth, s.pending, s.length) for s in lane_stats(redis_client, KEYS, "m")
            ] == [("interactive", 5, 0, 5), ("batch", 0, 0, 0)]
    redis_client.xgroup_create(interactive, GROUP, id="0")
    redis_client.xreadgroup(GROUP, "c1", {interactive: ">"}, count=3)
    got = lane_stats(redis_client, KEYS, "m")[0]
    assert (got.depth, got.pending, got.consumers, got.length) == (2, 3, 1, 5)
