"""One worker process: wires intake, engine loop, publisher, heartbeat and cancellation."""

from __future__ import annotations

import functools
import queue
import signal
import sys
import threading
import time
from dataclasses import astuple
from typing import Any

import redis
import structlog
import torch

from kvstore.tier.breaker import CLOSED, Breaker
from kvstore.tier.redis_tier import RedisKVTier
from producer.client.connection import connect, describe, resolve_url
from producer.clock import SYSTEM_CLOCK, Clock
from producer.long_lived import freeze_long_lived_objects
from producer.wire.completion import FinishReason
from producer.wire.keys import Keys
from worker.engine.engine import Engine
from worker.fleet.config import WorkerConfig
from worker.fleet.engine_loop import EngineLoop
from worker.fleet.faults import admission_fault_hook
from worker.fleet.handoff.engine_kv import kv_layout
from worker.fleet.handoff.handoff import HandoffReader, HandOnWriter
from worker.fleet.handoff.prefix_share import PrefixFinder, PrefixSharer
from worker.fleet.handoff.tier_io import TierReader, TierWriter
from worker.fleet.housekeeping.heartbeat import Heartbeat
from worker.fleet.housekeeping.leases import LeaseKeeper, hand_back
from worker.fleet.housekeeping.reaper import Reaper
from worker.fleet.housekeeping.registration import (
    check_eviction_policy,
    check_same_kind,
    load_chat_template,
    register_model,
)
from worker.fleet.inflight import InflightTable
from worker.fleet.intake.cancellation import CancelListener
from worker.fleet.intake.intake import Intake, IntakeParts
from worker.fleet.messages import Admission
from worker.fleet.metrics import (
    FaultCounts,
    HandoffCounts,
    PublisherCounts,
    QueuePoller,
    WorkerMetrics,
)
from worker.fleet.publishing.publisher import Publisher
from worker.fleet.publishing.text_stage import TextStage
from worker.fleet.supervised import SupervisedThread
from worker.host.cpu_placement import Placement, pin_engine_team, pin_io_thread, plan
from worker.host.openmp import release_thread_pool

log = structlog.get_logger(__name__)

# At stop, how long the publisher may take to write what it still holds (Redis may be down).
PUBLISHER_FLUSH_TIMEOUT_S = 10.0
# How long a stopping worker lets its KV tier threads finish what is queued (with KV).
TIER_DRAIN_S = 5.0


class Worker:
    """Serves one model from Redis until stopped; ``stop()`` drains in-flight work first.

    Every thread is a SupervisedThread with its own named Redis connection
    (``{worker_id}:{thread}`` in CLIENT LIST); a thread that fails for good brings the
    worker down (``serve`` returns 1) after its entries are handed back.
    """

    def __init__(self, config: WorkerConfig, engine: Engine | None = None,
                 clock: Clock | None = None) -> None:
        self.config = config
        self.keys = Keys(config.namespace)
        self.model = config.model_name
        self.clock = clock or (engine.clock if engine is not None else SYSTEM_CLOCK)
        # Text is made on the publisher thread (TextStage), not in the engine loop. A prefill
        # worker hands a request on right after its first token, with the KV of exactly its
        # prompt: no step of it may be under way beside that (worker/engine/step_pipeline.py).
        settings = {**config.engine, "detokenize": False}
        if config.role == "prefill":
            settings["async_scheduling"] = False
        self._owns_engine = engine is None
        self.engine = engine or Engine(config.model_dir, clock=self.clock, **settings)
        if self.engine.simulated and config.kv_share_prefixes:
            raise ValueError("a simulated worker has no KV to share: drop --kv-share-prefixes")
        self.chat_template = load_chat_template(config.model_dir, self.clock)
        self.redis_url = resolve_url(config.redis_url)
        self.client: redis.Redis = connect(self.redis_url)
        # Read in batches of half the prefetch: the other half keeps the engine's seats full.
        seats = self.engine.config.max_num_seqs
        prefetch = config.prefetch_for(seats)
        self.inflight = InflightTable(seats + prefetch, read_batch=prefetch // 2)
        self.inbox: queue.Queue[list[Admission]] = queue.Queue()
        self._failed = threading.Event()
        wid = config.worker_id
        sup = {"clock": self.clock, "on_fatal": self._thread_failed}
        # A stop string ends the request as `stop` in the engine, its metrics and logs too.
        text = TextStage(self.engine.tokenizer,
                         lambda rid: self.loop.end(rid, FinishReason.STOP))
        # The fleet KV tier (kvstore/tier): prefill workers write handoffs' KV, decode and
        # `both` workers read it. Checked against this engine's model fingerprint.
        layout = functools.partial(kv_layout, self.engine)  # at the first transfer, not now
        # One breaker for the worker's tier clients: they share one Redis.
        self.kv_breaker = Breaker(config.kv_breaker_open_s)
        publisher_client = self._client("publisher")
        hand_on = (HandOnWriter(publisher_client, self._kv_tier("kv-writer"), layout,
                                self.keys, self.model, wid)
                   if config.role == "prefill" else None)
        self.handoffs = (HandoffReader(self._kv_tier("kv-reader"), layout)
                         if config.role != "prefill" else None)
        share = config.kv_share_prefixes
        self.prefix_finder = (PrefixFinder(self._kv_tier("kv-prefix-reader"), layout,
                                           self._cached_here) if share else None)
        prefixes = PrefixSharer(self._kv_tier("kv-prefix-writer"), layout) if share else None
        # The tier's transfers run on threads of their own (worker/fleet/handoff/tier_io.py).
        self.tier_writer = (TierWriter(hand_on, prefixes, wid, config.kv_queue, **sup)
                            if hand_on is not None or prefixes is not None else None)
        self.tier_reader = (TierReader(self.inbox, wid, config.kv_queue, self.handoffs, **sup)
                            if self.handoffs is not None or share else None)
        self.publisher = Publisher(publisher_client, self.keys, wid, config.output_ttl_s, text,
                                   hand_on=hand_on, stream_interval=config.stream_interval,
                                   stream_interval_ms=config.stream_interval_ms,
                                   prefixes=prefixes, tier_writer=self.tier_writer, **sup)
        self.metrics = WorkerMetrics(self.model, wid, self.engine.stats)
        self.loop = EngineLoop(self.engine, self.inflight, self.inbox, self.publisher,
                               self.metrics, wid, role=config.role, kv_events=self.handoffs,
                               share_prefixes=share, on_admit=admission_fault_hook(),
                               hold_interval_s=0.0 if config.stream_interval is not None
                               else config.stream_interval_ms / 1000, **sup)
        self.intake = Intake(self._client("intake"), config, IntakeParts(
            self.inflight, self.inbox, self.publisher, self.loop.cancel, self.engine.tokenizer,
            self.chat_template, handoffs=self.handoffs, prefixes=self.prefix_finder,
            tier_reader=self.tier_reader,
            hand_ons_waiting=(lambda: self.tier_writer.waiting) if hand_on is not None else None,
            grammars=self.engine.checks.grammars, engine_state=self.loop.engine_state,
            on_refused=self.metrics.requests_refused,
        ), **sup)
        self.leases = LeaseKeeper(self._client("lease-keeper"), wid, self.inflight,
                                  config.lease_ms, self.loop.drop, keys=self.keys,
                                  on_orphaned=self.loop.cancel, **sup)
        self.reaper = Reaper(self._client("reaper"), self.keys, wid, self.intake, self.inflight,
                             config.lease_ms, config.max_deliveries,
                             # Often enough that a handed-back request moves at once.
                             interval_s=min(1.0, max(0.2, config.lease_ms / 2000)),
                             housekeeping_interval_s=config.housekeeping_interval_s, **sup)
        self.cancels = CancelListener(self._client("cancel-listener"), self.keys,
                                      self.loop.cancel, wid, self.inflight.ids, **sup)
        self.queue_poller = QueuePoller(self._client("queue-poller"), self.keys, self.model, wid,
                                        self.metrics, config.queue_poll_interval_s, **sup)
        self.heartbeat = Heartbeat(self._client("heartbeat"), self.keys, wid,
                                   config.heartbeat_interval_s, self.status, **sup)
        self.metrics.watch_faults(self.fault_counts)
        self.metrics.watch_handoffs(self.handoff_counts)
        self.metrics.watch_publisher(lambda: PublisherCounts(
            self.publisher.tokens_written, self.publisher.chunks_written,
            self.publisher.lag_tokens + self.loop.held_tokens))
        self.publisher.on_round_trip = self.metrics.redis_write.observe
        self.publisher.on_published = self.metrics.publish_delay.observe
        # The port /metrics is served on once started (None: not served).
        self.metrics_port: int | None = None
        self.state = "starting"
        # Threads started, in start order; the heartbeat reports the unhealthy ones.
        self.threads: list[SupervisedThread] = []
        self._started = time.monotonic()
        # (time, tokens generated) where the current tokens-per-second window began.
        self._rate_mark = (self._started, 0)

    def _cached_here(self, block_hash: bytes) -> bool:
        """Whether this engine's own prefix cache holds the block (read from the tier reader
        thread: a dict lookup, and a wrong answer costs only a transfer or a recompute)."""
        return (self.engine.config.enable_prefix_caching
                and self.engine.block_pool.lookup(block_hash) is not None)

    def _kv_tier(self, thread: str) -> RedisKVTier:
        url = resolve_url(self.config.kv_redis_url) if self.config.kv_redis_url \
            else self.redis_url
        timeout = self.config.kv_timeout_s
        client = connect(url, client_name=f"{self.config.worker_id}:{thread}",
                         retry_attempts=0, socket_timeout=timeout, connect_timeout=timeout)
        return RedisKVTier(client, self.config.namespace, ttl_s=self.config.kv_ttl_s,
                           max_bytes=self.config.kv_max_bytes, breaker=self.kv_breaker)

    def _client(self, thread: str) -> redis.Redis:
        # No retries inside redis-py: the thread's supervisor retries, and reports it meanwhile.
        return connect(self.redis_url, client_name=f"{self.config.worker_id}:{thread}",
                       retry_attempts=0)

    def status(self) -> dict[str, Any]:
        """Load, progress and health, for the heartbeat and `conveyor top`."""
        stats = self.engine.stats()
        unhealthy = [t.name for t in self.threads if not t.healthy]
        status = self.state
        if status == "serving" and unhealthy:
            status = "degraded"
        return {
            "status": status,
            # Threads retrying a lost Redis connection, or dead (the worker then goes down).
            "unhealthy_threads": ",".join(unhealthy),
            "model": self.model,
            # "1": a simulated engine (no forward; tokens a function of each seed).
            "simulated": "1" if self.engine.simulated else "",
            "running": stats["running"],
            "waiting": stats["waiting"],
            "swapped": stats.get("swapped", 0),
            "inflight": len(self.inflight),
            # Requests the intake would read now ("0": full, busy (a long step, requests
            # waiting for the batch) or its intake is failing: prefix affinity's peers take
            # over what waits in its lanes).
            "room": self.inflight.room() if self.intake.healthy and not self.intake.busy else 0,
            "kv_blocks_used": stats["kv_blocks_used"],
            "kv_blocks_total": stats["kv_blocks_total"],
            "tokens_generated": self.loop.tokens_generated,
            "tokens_per_s": self._tokens_per_s(),
            "steps": stats["steps"],
            # A simulated engine: milliseconds its steps took (0 for a real one).
            "simulated_busy_ms": stats.get("simulated_busy_ms", 0),
            "preemptions": stats.get("preemptions", 0),
            # Tasks a decode step's master took over from a thread that lost its core.
            "step_team_takeovers": stats.get("step_team_takeovers", 0),
            "metrics_port": self.metrics_port or "",
            # Request streams no producer can add to (an entry at the largest id).
            "blocked_lanes": ",".join(self.reaper.blocked_lanes),
            # Requests cancelled because their producer's watch lapsed (its producer died).
            "watch_cancelled": self.leases.orphaned,
            # Producers' watches found missing, their requests cancelled if they stay so.
            "watches_missing": self.leases.watches_missing,
            # conveyor's Redis functions: ours, missing, modified, unsupported (Redis 6.2).
            "functions": self.heartbeat.functions,
            # Disaggregation: this worker's role, prompt tokens it computed or imported, and
            # handoffs sent, received with KV, or recomputed (by cause).
            "role": self.config.role,
            "prompt_tokens_computed": stats.get("prompt_tokens_computed", 0),
            # Prompt tokens its own prefix cache served (cache-aware pull's measure).
            "prefix_cache_hit_tokens": stats.get("prefix_cache_hit_tokens", 0),
            # Prefix affinity: "1" when on; requests taken from other workers' affinity
            # lanes (waited past the delay, or their worker gone); prefixes advertised.
            "affinity": "1" if self.intake.advertiser is not None else "",
            "affinity_taken": self.intake.takeover.taken if self.intake.takeover else 0,
            "affinity_advertised": (self.intake.advertiser.advertised
                                    if self.intake.advertiser else 0),
            # The generation of the owners' hashes it writes now (producers read the one
            # the heartbeats name).
            "affinity_generation": (self.intake.advertiser.generation()
                                    if self.intake.advertiser else ""),
            "kv_imported_tokens": stats.get("kv_imported_tokens", 0),
            "handed_on": self.publisher.hand_on.handed_on if self.publisher.hand_on else 0,
            "kv_imported": self.handoffs.imported if self.handoffs else 0,
            "kv_fallbacks": ",".join(f"{k}={v}" for k, v in sorted(
                self.handoffs.fallbacks.items())) if self.handoffs else "",
            # Fleet prefix reuse: blocks put in the tier, and requests that found theirs there.
            "kv_prefix_blocks_put": self.publisher.prefixes.blocks_put
            if self.publisher.prefixes else 0,
            "kv_prefix_hits": self.prefix_finder.hits if self.prefix_finder else 0,
            "kv_prefix_hit_tokens": self.prefix_finder.hit_tokens if self.prefix_finder else 0,
            # KV moved through the tier: bytes, seconds and transfers put (handoffs written)
            # and got (handoffs fetched); `conveyor bench` reports time per document from it.
            **_transfer_fields("kv_put", self.publisher.hand_on.transfers
                               if self.publisher.hand_on else None),
            **_transfer_fields("kv_get", self.handoffs.transfers if self.handoffs else None),
            # The KV tier's breaker: closed, open (the tier is skipped: it did not answer
            # within --kv-timeout), half-open (the next call probes it); "" without a tier.
            "kv_tier_breaker": self.kv_breaker.state if self._uses_tier else "",
            "kv_tier_breaker_opened": self.kv_breaker.opened,
            "kv_tier_skipped": self.kv_breaker.skipped,
            # Transfers sent on without the tier because its thread's queue was full.
            "kv_tier_queue_overflows": self._tier_overflows(),
        }

    def _tier_overflows(self) -> int:
        return sum(t.overflowed for t in (self.tier_writer, self.tier_reader) if t is not None)

    @property
    def _uses_tier(self) -> bool:
        return self.tier_writer is not None or self.tier_reader is not None

    def handoff_counts(self) -> HandoffCounts:
        """This worker's prefill/decode handoffs, for its metrics."""
        writer = self.publisher.hand_on
        return HandoffCounts(
            handed_on=writer.handed_on if writer else 0,
            kv_put_refused=writer.kv_refused if writer else 0,
            kv_imported=self.handoffs.imported if self.handoffs else 0,
            fallbacks=dict(self.handoffs.fallbacks) if self.handoffs else {},
            put=astuple(writer.transfers) if writer else (0, 0.0, 0),
            got=astuple(self.handoffs.transfers) if self.handoffs else (0, 0.0, 0),
            breaker_open=self.kv_breaker.state != CLOSED,
            queue_overflows=self._tier_overflows(),
            breaker_opened=self.kv_breaker.opened,
            tier_skipped=self.kv_breaker.skipped,
        )

    def fault_counts(self) -> FaultCounts:
        """The Redis faults this worker met and recovered from, for its metrics."""
        return FaultCounts(
            retries={t.name: t.transient_errors for t in self.threads},
            healthy={t.name: t.healthy for t in self.threads},
            refused_writes=self.publisher.refused_writes,
            reclaimed=self.reaper.claimed,
            isolated=self.reaper.isolated,
            dead_letters=self.publisher.dead_letters,
            consumers_removed=self.reaper.sweeper.removed,
        )

    def _tokens_per_s(self) -> float:
        """Generation rate since the previous call at least a second ago (a heartbeat)."""
        now, tokens = time.monotonic(), self.loop.tokens_generated
        mark_t, mark_n = self._rate_mark
        rate = (tokens - mark_n) / max(1e-9, now - mark_t)
        if now - mark_t >= 1.0:
            self._rate_mark = (now, tokens)
        return round(rate, 1)

    def start(self) -> None:
        check_eviction_policy(self.client, self.config.allow_eviction)
        self.heartbeat.beat()  # "starting", with its model and kind: check_same_kind says why
        try:
            self._prepare()
        except BaseException:
            self.heartbeat.clear()  # never serving: no "starting" hash left behind
            self.metrics.close()
            raise
        self.state = "serving"
        self.heartbeat.beat()
        # The engine was built on this thread; its steps run on the loop's, which must be
        # the process's only OpenMP team (worker/host/openmp.py says why).
        release_thread_pool()
        placement = self._placement()
        for thread in self.threads:
            thread.yields_to_compute = (
                self.config.batch_io_threads and thread is not self.loop
                and (thread is not self.publisher or self.config.batch_publisher))
            if placement is not None:
                thread.on_start = functools.partial(
                    pin_engine_team if thread is self.loop else pin_io_thread, placement)
            thread.start()
        self.cancels.subscribed.wait(timeout=5)
        log.info("worker serving", worker_id=self.config.worker_id, model=self.model,
                 redis=describe(self.config.redis_url) if self.config.redis_url else "embedded",
                 metrics_port=self.metrics_port)
        if self.engine.simulated:
            log.warning("SIMULATED engine: no forward, its tokens are a function of each "
                        "request's seed, not the model's (worker/engine/simulated.py)",
                        model=self.model, step_cost=self.engine.simulated_cost.to_dict())

    @property
    def failed(self) -> SupervisedThread | None:
        """The first thread that failed for good, if one did."""
        return next((t for t in self.threads if t.failure is not None), None)

    def stop(self, drain_timeout_s: float | None = None) -> bool:
        """Stop reading, let in-flight requests finish (up to the drain timeout), then stop.

        Returns True when everything in flight finished. What is still unfinished has its
        published tokens flushed and is handed back (its lease made to look expired), so
        another worker claims it at once and continues after those tokens. After a thread
        failed the worker does not wait: everything in flight is handed back.
        """
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        failed = self.failed is not None
        self.state = "failed" if failed else "draining"
        self._beat_once()
        for thread in (self.intake, self.reaper):
            thread.stop()
        if self.tier_reader is not None:  # what still waits for a fetch goes on without it
            self.tier_reader.close(min(TIER_DRAIN_S, timeout))
        drained = not failed and self.inflight.wait_empty(timeout)
        self.loop.stop()
        if self._owns_engine:
            self.engine.close()  # its runner thread, if it steps overlapped
        flushed = self.publisher.close(PUBLISHER_FLUSH_TIMEOUT_S)
        if not flushed:
            log.warning("output could not be flushed to redis; its requests are handed back "
                        "and resume from what was published")
        if self.tier_writer is not None:  # what still waits for the tier goes without KV
            self.tier_writer.close(TIER_DRAIN_S, reachable=flushed)
        self._hand_back_unfinished()
        for thread in (self.leases, self.cancels, self.heartbeat, self.queue_poller):
            thread.stop()
        self.heartbeat.clear()
        self.metrics.close()
        self.state = "failed" if failed else "stopped"
        log.info("worker stopped", worker_id=self.config.worker_id, drained=drained,
                 failed_thread=self.failed.name if failed else None)
        return drained

    def serve(self, stop: threading.Event) -> int:
        """Start, serve until ``stop`` is set or a thread fails, then stop; the exit status:
        0 after a drain, 1 when a thread failed (its entries were handed back)."""
        self.start()
        while not stop.is_set() and not self._failed.is_set():
            stop.wait(0.2)
        self.stop(0 if self._failed.is_set() else None)
        return 1 if self.failed is not None else 0

    def run_until_signalled(self) -> int:
        """Serve until SIGTERM or SIGINT, then drain; the exit status for the process."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        if self.config.gil_switch_interval_s is not None:
            # This process is the worker's own: its threads are ours to tune.
            sys.setswitchinterval(self.config.gil_switch_interval_s)
        # The engine is built: what the process holds now, it holds for good.
        freeze_long_lived_objects()
        return self.serve(stop)

    def _prepare(self) -> None:
        """Everything before the threads start, once this worker's heartbeat is out."""
        check_same_kind(self.client, self.keys, self.model, self.engine.simulated,
                        self.config.worker_id)
        if self.config.metrics_port is not None:  # (first: a port in use refuses the
            # worker before it registers anything)
            self.metrics_port = self.metrics.serve(self.config.metrics_port,
                                                   self.config.metrics_host)
        self._register(self.client)
        self.heartbeat.keep_registration(self.keys.model(self.model), self._register)
        # Before any thread runs: the reaper must not meet a group the intake has not made yet.
        self.intake.prepare_streams(self.client)
        self.reaper.check_lanes()
        self.heartbeat.keep_functions()
        self.threads = [self.publisher, self.loop, self.cancels, self.intake, self.heartbeat,
                        self.leases, self.reaper]
        self.threads += [t for t in (self.tier_writer, self.tier_reader) if t is not None]
        if self.config.metrics_port is not None:
            self.threads.append(self.queue_poller)

    def _register(self, client: redis.Redis) -> None:
        """Write the model's registration (at start, and again where a beat finds it gone)."""
        register_model(client, self.keys, self.model, self.engine, self.config.model_dir,
                       self.config.worker_id, self.chat_template)

    def _placement(self) -> Placement | None:
        """Where the threads go (worker/host/cpu_placement.py), or None to leave them to the
        OS: placing is off, the engine is not on the CPU or steps overlapped, or its team
        does not fit the plan."""
        if (not self.config.place_threads or self.engine.device.type != "cpu"
                or self.engine.async_scheduling):
            # Overlapped steps run the forward on the engine's runner thread, which the loop
            # makes later: it would inherit the loop's one CPU, its team with it.
            return None
        placement = plan(torch.get_num_threads())
        if placement is not None:
            log.info("threads placed", engine_cpus=list(placement.team),
                     io_cpus=sorted(placement.io))
        return placement

    def _thread_failed(self, thread: SupervisedThread) -> None:
        log.error("a worker thread failed: handing back in-flight requests and exiting",
                  thread=thread.name, error=repr(thread.failure))
        self._failed.set()

    def _beat_once(self) -> None:
        """Write the heartbeat now (from the caller's thread), so the state change shows."""
        try:
            self.heartbeat.beat()
        except redis.RedisError:
            pass  # the hash expires with its TTL

    def _hand_back_unfinished(self) -> None:
        left = [e for rid in self.inflight.ids() if (e := self.inflight.get(rid)) is not None]
        if not left:
            return
        try:
            # (one entry for all the choices of a request)
            entries = list(dict.fromkeys((e.stream, e.entry_id) for e in left))
            hand_back(self.client, self.config.worker_id, entries, self.config.lease_ms)
            log.info("handed back unfinished requests", count=len(left))
        except redis.RedisError as exc:  # they lapse with the lease instead
            log.warning("hand back failed; requests wait for their lease to lapse",
                        error=str(exc))


def _transfer_fields(prefix: str, transfers: Any) -> dict[str, Any]:
    if transfers is None:
        return {f"{prefix}_bytes": 0, f"{prefix}_s": 0.0, f"{prefix}_count": 0}
    return {f"{prefix}_bytes": transfers.bytes, f"{prefix}_s": round(transfers.seconds, 6),
            f"{prefix}_count": transfers.count}
