"""Prometheus metrics of one worker: request latencies, tokens, engine load, lane queues.

Each worker has its own registry (two workers can share a process in tests). The engine
loop feeds the request and step metrics without touching Redis; engine gauges and counters
are read from ``Engine.stats()`` when scraped; lane depths come from :class:`QueuePoller`.
Every metric carries a ``model`` label. The table is in docs/observability.md.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer

import redis
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from producer.client.queues import LaneStats, lane_stats
from producer.wire.completion import FinishReason
from producer.wire.keys import LANES, Keys
from worker.fleet.supervised import SupervisedThread

# No `*_created` series beside every counter and histogram: they double what is scraped.
disable_created_metrics()

# Seconds. TTFT and queue wait span milliseconds (idle fleet) to minutes (a deep backlog).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# Seconds. One decode step on a busy worker: a few ms on a GPU to a few hundred on a CPU.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
                2.56, 5.12)
# Tokens computed in one forward pass (decodes plus prefill chunks), up to the step budget.
TOKENS_PER_STEP_BUCKETS = tuple(float(2**i) for i in range(15))

# One publisher write round trip to Redis: a batch of XADDs, scripts and EXPIREs.
REDIS_WRITE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                       0.25, 0.5, 1.0)
# A step's output to Redis: a round trip, plus the wait for the publisher (up to
# MAX_BACKLOG_STEPS steps) and retries' backoff when Redis is in trouble.
PUBLISH_DELAY_BUCKETS = (*REDIS_WRITE_BUCKETS, 2.5, 5.0, 10.0, 30.0)

PREEMPTION_MODES = ("recompute", "swap")

# Engine.stats() key -> (metric, help); exported when the engine reports the key.
ENGINE_GAUGES = {
    "simulated": ("conveyor_engine_simulated", "1 for a simulated engine (no forward: its "
                  "tokens are not the model's; worker/engine/simulated.py), else 0."),
    "running": ("conveyor_requests_running", "Requests in the running batch."),
    "waiting": ("conveyor_requests_waiting", "Requests admitted to the engine, not yet running."),
    "swapped": ("conveyor_requests_swapped", "Preempted requests whose KV is in host memory."),
    "kv_blocks_used": ("conveyor_kv_blocks_used", "Device KV blocks held by requests."),
    "kv_blocks_total": ("conveyor_kv_blocks_total", "Device KV blocks in the pool."),
    "kv_pool_bytes": ("conveyor_kv_pool_bytes", "Bytes of the device KV pool."),
    "gpu_memory_utilization": ("conveyor_gpu_memory_utilization",
                               "The share of the GPU's memory the engine may hold, that its "
                               "KV pool was sized from (absent where not so sized)."),
    "cuda_graph_buckets": ("conveyor_cuda_graph_buckets",
                           "Decode batch sizes captured in CUDA graphs at start (absent "
                           "where none are: not CUDA, --enforce-eager, or not the paged "
                           "attention backend)."),
    "cuda_graph_memory_bytes": ("conveyor_cuda_graph_memory_bytes",
                                "GPU memory the captured decode graphs hold."),
    "kv_blocks_cached": ("conveyor_kv_blocks_cached",
                         "Device KV blocks holding a findable prefix block (used or free)."),
    "host_blocks_used": ("conveyor_host_kv_blocks_used", "Host (swap) KV blocks in use."),
    "host_blocks_total": ("conveyor_host_kv_blocks_total", "Host (swap) KV blocks in the pool."),
    # With --itl-target-ms: what a step costs, as the engine learnt it (scheduler/step_cost.py).
    "step_cost_base_s": ("conveyor_step_cost_base_seconds", "Learnt cost of a step itself."),
    "step_cost_prefill_token_s": ("conveyor_step_cost_prefill_token_seconds",
                                  "Learnt cost of a prefill token in a step."),
    "step_cost_decode_row_s": ("conveyor_step_cost_decode_row_seconds",
                               "Learnt cost of a decode row in a step."),
    "step_cost_context_token_s": ("conveyor_step_cost_context_token_seconds",
                                  "Learnt cost of a context token attended over in a step."),
    "step_cost_chunk_attention_s": ("conveyor_step_cost_chunk_attention_seconds",
                                    "Learnt cost of a position a prefill chunk's later "
                                    "tokens attend over besides."),
}
ENGINE_COUNTERS = {
    "steps": ("conveyor_engine_steps", "Engine steps that ran a forward pass."),
    "cuda_graph_replays": ("conveyor_cuda_graph_replays",
                           "Decode steps replayed from a captured CUDA graph."),
    "computed_tokens": ("conveyor_computed_tokens", "Tokens run through the model."),
    "swapped_out_blocks": ("conveyor_kv_swapped_out_blocks", "KV blocks copied device to host."),
    "swapped_in_blocks": ("conveyor_kv_swapped_in_blocks", "KV blocks copied host to device."),
    "prefix_cache_queries": ("conveyor_prefix_cache_queries",
                             "Tokens looked up in the prefix cache at admission."),
    "prefix_cache_hit_tokens": ("conveyor_prefix_cache_hits",
                                "Tokens found in the prefix cache at admission."),
    "prefix_cache_evictions": ("conveyor_prefix_cache_evictions",
                               "Cached blocks evicted for new allocations."),
    "prompt_tokens_computed": ("conveyor_prompt_tokens_computed",
                               "Prompt tokens run through the model (prefill, recompute)."),
    "kv_imported_tokens": ("conveyor_kv_imported_tokens",
                           "Prompt tokens whose KV came from the fleet KV tier instead."),
    # Structured outputs (worker/sampling/grammar.py).
    "grammar_compiles": ("conveyor_grammar_compiles",
                         "response_format grammars compiled (each distinct format once)."),
    "grammar_compile_seconds": ("conveyor_grammar_compile_seconds",
                                "Seconds spent compiling response_format grammars."),
    "grammar_cache_hits": ("conveyor_grammar_cache_hits",
                           "Constrained requests whose grammar was compiled already."),
    "grammar_mask_rows": ("conveyor_grammar_mask_rows",
                          "Next-token masks made for constrained rows."),
    "grammar_mask_seconds": ("conveyor_grammar_mask_seconds",
                             "Seconds spent making next-token masks (before each forward)."),
}


class WorkerMetrics:
    """The metrics of one worker, in their own registry; ``serve()`` exposes them over HTTP."""

    def __init__(self, model: str, worker_id: str,
                 engine_stats: Callable[[], Mapping[str, object]]) -> None:
        self.model = model
        self.registry = r = CollectorRegistry()
        m = ["model"]
        Gauge("conveyor_worker_info", "Always 1; labels name the worker and its model.",
              ["model", "worker_id"], registry=r).labels(model, worker_id).set(1)
        self.admitted = Counter("conveyor_requests_admitted", "Requests the engine took on.",
                                ["model", "lane"], registry=r)
        self.finished = Counter("conveyor_requests_finished",
                                "Requests answered with a final entry, by finish reason.",
                                ["model", "finish_reason"], registry=r)
        # (admitted here, never finished here: every admitted request is finished or lost)
        self.leases_lost = Counter("conveyor_leases_lost",
                                   "Requests stopped here because another worker took them "
                                   "over (their lease lapsed: Redis lost it, or this worker "
                                   "stalled).", m, registry=r).labels(model)
        self.prompt_tokens = Counter("conveyor_prompt_tokens", "Prompt tokens admitted.", m,
                                     registry=r).labels(model)
        self.generation_tokens = Counter("conveyor_generation_tokens", "Tokens generated.", m,
                                         registry=r).labels(model)
        self.cached_tokens = Counter("conveyor_prefix_cached_tokens",
                                     "Prompt tokens of finished requests served from the "
                                     "prefix cache.", m, registry=r).labels(model)
        self.ttft = Histogram("conveyor_time_to_first_token_seconds",
                              "Request created (created_ms) to its first token.", m,
                              buckets=TTFT_BUCKETS, registry=r).labels(model)
        # Observed for every token: counted without prometheus_client's lock (one thread
        # feeds it), read at scrape (_TokenGaps).
        self.itl = TokenGaps(ITL_BUCKETS)
        r.register(_TokenGapsCollector(model, self.itl))
        self.queue_wait = Histogram("conveyor_request_queue_wait_seconds",
                                    "Request created (created_ms) to admitted by a worker.", m,
                                    buckets=TTFT_BUCKETS, registry=r).labels(model)
        self.e2e = Histogram("conveyor_e2e_request_latency_seconds",
                             "Request created (created_ms) to its final entry.", m,
                             buckets=E2E_BUCKETS, registry=r).labels(model)
        self.step_time = Histogram("conveyor_step_duration_seconds",
                                   "Wall time of one engine step.", m, buckets=STEP_BUCKETS,
                                   registry=r).labels(model)
        self.step_tokens = Histogram("conveyor_step_tokens", "Tokens computed in one step.", m,
                                     buckets=TOKENS_PER_STEP_BUCKETS, registry=r).labels(model)
        self.redis_write = Histogram("conveyor_redis_write_seconds",
                                     "Round trip of one publisher write batch to Redis.", m,
                                     buckets=REDIS_WRITE_BUCKETS, registry=r).labels(model)
        self.publish_delay = Histogram(
            "conveyor_publish_delay_seconds",
            "A step's output handed to the publisher to its entries in Redis (not a stream "
            "interval's hold).", m, buckets=PUBLISH_DELAY_BUCKETS, registry=r).labels(model)
        depth = Gauge("conveyor_queue_depth", "Requests in a lane not yet read by any worker.",
                      ["model", "lane"], registry=r)
        pending = Gauge("conveyor_queue_pending",
                        "Requests read from a lane and not yet acknowledged.",
                        ["model", "lane"], registry=r)
        self._lanes = {lane: (depth.labels(model, lane), pending.labels(model, lane))
                       for lane in LANES}
        for lane in LANES:  # children exist from the start: a panel never shows "no data"
            self.admitted.labels(model, lane)
        for reason in FinishReason:
            self.finished.labels(model, str(reason))
        r.register(_EngineStatsCollector(model, engine_stats))
        self._faults = _FaultsCollector(model)
        r.register(self._faults)
        self._handoffs = _HandoffsCollector(model)
        r.register(self._handoffs)
        self._publisher = _PublisherCollector(model)
        r.register(self._publisher)
        self._server: WSGIServer | None = None
        self._server_thread: threading.Thread | None = None

    # ----- fed by the engine loop (no I/O) -----

    def request_admitted(self, lane: str, prompt_tokens: int,
                         queue_wait_s: float | None) -> None:
        """``queue_wait_s`` None: a request resumed after its first token went out (a
        take-over, a handoff): it waited for that once, on the worker that sent it."""
        self.admitted.labels(self.model, lane).inc()
        self.prompt_tokens.inc(prompt_tokens)
        if queue_wait_s is not None:
            self.queue_wait.observe(queue_wait_s)

    def request_finished(self, reason: str, e2e_s: float, cached_tokens: int) -> None:
        self.finished.labels(self.model, reason).inc()
        self.e2e.observe(e2e_s)
        if cached_tokens:
            self.cached_tokens.inc(cached_tokens)

    def requests_refused(self, count: int) -> None:
        """Requests the intake answered ``error`` before the engine saw them (malformed,
        another model's, a format it cannot serve): finished, with no latency to time."""
        self.finished.labels(self.model, "error").inc(count)

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def token_gap(self, seconds_per_token: float, num_tokens: int = 1) -> None:
        self.itl.observe(seconds_per_token, num_tokens)

    def tokens_generated(self, num_tokens: int) -> None:
        self.generation_tokens.inc(num_tokens)

    def step_done(self, seconds: float, tokens: int) -> None:
        self.step_time.observe(seconds)
        self.step_tokens.observe(tokens)

    def watch_faults(self, faults: Callable[[], FaultCounts]) -> None:
        """Read the worker's fault counters (``faults()``) at each scrape."""
        self._faults.read = faults

    def watch_publisher(self, publisher: Callable[[], PublisherCounts]) -> None:
        """Read the publisher's tokens, chunks and lag at each scrape."""
        self._publisher.read = publisher

    def watch_handoffs(self, handoffs: Callable[[], HandoffCounts]) -> None:
        """Read the worker's prefill/decode handoff counters at each scrape."""
        self._handoffs.read = handoffs

    # ----- fed by the queue poller -----

    def set_lanes(self, lanes: Iterable[LaneStats]) -> None:
        for s in lanes:
            depth, pending = self._lanes[s.lane]
            depth.set(s.depth)
            pending.set(s.pending)

    # ----- HTTP -----

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve /metrics on ``host:port`` (0: any free port); returns the bound port."""
        try:
            self._server, self._server_thread = start_http_server(port, host, self.registry)
        except OSError as exc:  # (in use, or not ours to bind: one line, not a traceback)
            raise ValueError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@dataclass
class FaultCounts:
    """How a worker met Redis faults, since it started (read at scrape time)."""

    # Per thread: Redis errors retried (connection, timeout, refusals); whether it is healthy.
    retries: dict[str, int] = field(default_factory=dict)
    healthy: dict[str, bool] = field(default_factory=dict)
    refused_writes: int = 0  # output batches Redis refused (each written later)
    reclaimed: int = 0  # lapsed entries of other workers claimed and resumed
    isolated: int = 0  # suspect requests (their workers kept dying) served alone
    dead_letters: int = 0  # entries written to the dead-letter stream
    consumers_removed: int = 0  # dead workers' consumers removed from the group


def _by_model(family: type, model: str,
              rows: Iterable[tuple[str, str, float]]) -> Iterator[Metric]:
    """One ``family`` (CounterMetricFamily or GaugeMetricFamily) a (name, doc, value) row,
    labelled with the model."""
    for name, doc, value in rows:
        metric = family(name, doc, labels=["model"])
        metric.add_metric([model], float(value))
        yield metric


class TokenGaps:
    """A histogram fed by one thread, for every token: a bucket count goes up by a list
    index, with no lock (prometheus_client's Histogram takes one, and at a GPU's rate of
    tokens that lock and its bookkeeping cost the engine loop ~9% of its time). A scrape
    copies the counts in one go: they add up to the count it reports; the sum may lag it
    by an observation."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times


class _TokenGapsCollector(Collector):
    def __init__(self, model: str, gaps: TokenGaps) -> None:
        self.model, self.gaps = model, gaps

    def collect(self) -> Iterable[Metric]:
        counts, total = list(self.gaps.counts), self.gaps.sum
        metric = HistogramMetricFamily("conveyor_inter_token_latency_seconds",
                                       "Time between consecutive tokens of a request.",
                                       labels=["model"])
        cumulative, running = [], 0
        for bound, count in zip((*self.gaps.bounds, float("inf")), counts, strict=True):
            running += count
            cumulative.append((floatToGoString(bound), running))
        metric.add_metric([self.model], cumulative, total)
        yield metric


class _ReadAtScrape(Collector):
    """Counts a part of the worker keeps, read through ``read`` at each scrape; nothing
    until the worker sets it."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.read: Callable[[], Any] | None = None

    def collect(self) -> Iterable[Metric]:
        if self.read is not None:
            yield from self.families(self.read())

    def families(self, counts: Any) -> Iterable[Metric]:
        raise NotImplementedError


@dataclass
class PublisherCounts:
    """What a worker's publisher wrote since it started, and what it owes (read at scrape)."""

    tokens: int = 0  # output tokens written to Redis
    chunks: int = 0  # output chunks written (chunks / tokens: the stream interval at work)
    lag_tokens: int = 0  # tokens the engine made that are not in Redis yet


class _PublisherCollector(_ReadAtScrape):
    def families(self, p: PublisherCounts) -> Iterable[Metric]:
        yield from _by_model(CounterMetricFamily, self.model, (
            ("conveyor_output_tokens_published", "Output tokens written to Redis.", p.tokens),
            ("conveyor_output_chunks", "Output chunks written to Redis (per token: how far "
             "--stream-interval-ms coalesces).", p.chunks)))
        yield from _by_model(GaugeMetricFamily, self.model, (
            ("conveyor_publisher_lag_tokens", "Tokens the engine made that are not in Redis "
             "yet (queued, held by the stream interval, or owed to a retry).",
             p.lag_tokens),))


@dataclass
class HandoffCounts:
    """Prefill/decode handoffs of a worker since it started (read at scrape time)."""

    handed_on: int = 0  # requests this prefill worker handed on
    kv_put_refused: int = 0  # handoffs whose KV the tier refused (sent without KV)
    kv_imported: int = 0  # handed-on requests taken here with their KV
    fallbacks: dict[str, int] = field(default_factory=dict)  # recomputed instead, by cause
    # KV moved through the tier: (bytes, seconds, runs) put by a prefill worker, and got.
    put: tuple[int, float, int] = (0, 0.0, 0)
    got: tuple[int, float, int] = (0, 0.0, 0)
    # The tier's breaker (kvstore/tier/breaker.py): open now, times it opened, and tier
    # calls it turned away.
    breaker_open: bool = False
    breaker_opened: int = 0
    tier_skipped: int = 0
    # Transfers sent on without the tier: its thread's queue was full.
    queue_overflows: int = 0


class _HandoffsCollector(_ReadAtScrape):
    def families(self, h: HandoffCounts) -> Iterable[Metric]:
        yield from _by_model(CounterMetricFamily, self.model, (
            ("conveyor_kv_handoffs_sent", "Requests handed on to decode workers.", h.handed_on),
            ("conveyor_kv_tier_refused", "Handoffs sent without KV: the tier refused it.",
             h.kv_put_refused),
            ("conveyor_kv_handoffs_imported", "Handed-on requests taken with their KV.",
             h.kv_imported),
            ("conveyor_kv_tier_breaker_opened",
             "Times the KV tier's breaker opened: a round trip got no answer in time.",
             h.breaker_opened),
            ("conveyor_kv_tier_skipped", "KV tier calls skipped while its breaker was open.",
             h.tier_skipped),
            ("conveyor_kv_tier_queue_overflows",
             "KV transfers sent on without the tier: its thread's queue was full.",
             h.queue_overflows),
        ))
        for name, doc, index in (
            ("conveyor_kv_transfer_bytes", "KV bytes moved through the tier, by direction.", 0),
            ("conveyor_kv_transfer_seconds", "Seconds spent moving KV through the tier.", 1),
            ("conveyor_kv_transfers", "Runs of KV moved through the tier.", 2),
        ):
            c = CounterMetricFamily(name, doc, labels=["model", "direction"])
            c.add_metric([self.model, "put"], float(h.put[index]))
            c.add_metric([self.model, "get"], float(h.got[index]))
            yield c
        c = CounterMetricFamily("conveyor_kv_handoff_fallbacks",
                                "Handed-on requests that recomputed their prompt, by cause.",
                                labels=["model", "cause"])
        for cause in ("missing", "corrupt", "mismatch", "no_room", "unreachable", "busy"):
            c.add_metric([self.model, cause], float(h.fallbacks.get(cause, 0)))
        yield c
        yield from _by_model(GaugeMetricFamily, self.model, (
            ("conveyor_kv_tier_breaker_open", "1 while the KV tier's breaker is not closed "
             "(calls are skipped, or one probes the tier), else 0.", h.breaker_open),))


class _FaultsCollector(_ReadAtScrape):
    """Redis faults met and recovered from; nothing until the worker starts watching."""

    def families(self, f: FaultCounts) -> Iterable[Metric]:
        retries = CounterMetricFamily("conveyor_redis_retries",
                                      "Redis errors a worker thread met and retried.",
                                      labels=["model", "thread"])
        healthy = GaugeMetricFamily("conveyor_thread_healthy",
                                    "1 while a worker thread reaches Redis, 0 while it retries.",
                                    labels=["model", "thread"])
        for thread, n in f.retries.items():
            retries.add_metric([self.model, thread], float(n))
            healthy.add_metric([self.model, thread], float(f.healthy.get(thread, True)))
        yield retries
        yield healthy
        yield from _by_model(CounterMetricFamily, self.model, (
            ("conveyor_redis_refused_writes", "Output batches Redis refused; each is retried.",
             f.refused_writes),
            ("conveyor_reclaimed_requests", "Lapsed entries of dead workers claimed here.",
             f.reclaimed),
            ("conveyor_isolated_requests", "Suspect requests served alone (poison isolation).",
             f.isolated),
            ("conveyor_dead_letters", "Entries written to the dead-letter stream.",
             f.dead_letters),
            ("conveyor_consumers_removed", "Dead workers' consumers removed from the group.",
             f.consumers_removed),
        ))


class _EngineStatsCollector(Collector):
    """Reads ``Engine.stats()`` at scrape time: gauges now, counters since the engine started."""

    def __init__(self, model: str, stats: Callable[[], Mapping[str, object]]) -> None:
        self.model = model
        self.stats = stats

    def collect(self) -> Iterable[Metric]:
        stats = self.stats()
        for key, (name, doc) in ENGINE_GAUGES.items():
            if key in stats:
                g = GaugeMetricFamily(name, doc, labels=["model"])
                g.add_metric([self.model], float(stats[key]))  # type: ignore[arg-type]
                yield g
        for key, (name, doc) in ENGINE_COUNTERS.items():
            if key in stats:
                c = CounterMetricFamily(name, doc, labels=["model"])
                c.add_metric([self.model], float(stats[key]))  # type: ignore[arg-type]
                yield c
        c = CounterMetricFamily("conveyor_preemptions", "Requests preempted, by mode.",
                                labels=["model", "mode"])
        for mode, n in _preemptions_by_mode(stats).items():
            c.add_metric([self.model, mode], float(n))
        yield c


def _preemptions_by_mode(stats: Mapping[str, object]) -> dict[str, int]:
    """``preemptions_<mode>`` keys when the engine reports them; else all count as recompute."""
    by_mode = {mode: int(stats.get(f"preemptions_{mode}", 0)) for mode in PREEMPTION_MODES}
    if not any(f"preemptions_{mode}" in stats for mode in PREEMPTION_MODES):
        by_mode["recompute"] = int(stats.get("preemptions", 0))  # type: ignore[call-overload]
    return by_mode


class QueuePoller(SupervisedThread):
    """Every interval, reads the depth and pending count of the model's lanes into metrics.

    Its own thread and its own reads, so neither the engine loop nor a scrape waits on Redis.
    """

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str,
                 metrics: WorkerMetrics, interval_s: float, **supervision: Any) -> None:
        super().__init__("queue-poller", worker_id=worker_id, interval_s=interval_s,
                         **supervision)
        self.client = client
        self.keys = keys
        self.model = model
        self.metrics = metrics

    def tick(self) -> None:
        self.metrics.set_lanes(lane_stats(self.client, self.keys, self.model))
