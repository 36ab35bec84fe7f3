"""One worker process: wires intake, engine loop, publisher, heartbeat and cancellation."""

from __future__ import annotations

import queue
import signal
import threading
import time
from typing import Any

import redis
import structlog

from producer.connection import connect, describe
from producer.wire.keys import Keys
from worker.engine import Engine
from worker.fleet.cancellation import CancelListener
from worker.fleet.config import WorkerConfig
from worker.fleet.engine_loop import EngineLoop
from worker.fleet.heartbeat import Heartbeat
from worker.fleet.inflight import InflightTable
from worker.fleet.intake import Admission, Intake
from worker.fleet.leases import LeaseKeeper, hand_back
from worker.fleet.publisher import Publisher
from worker.fleet.reaper import Reaper
from worker.fleet.registration import register_model
from worker.fleet.text_stage import TextStage
from worker.metrics import QueuePoller, WorkerMetrics

log = structlog.get_logger(__name__)


class Worker:
    """Serves one model from Redis until stopped; ``stop()`` drains in-flight work first."""

    def __init__(self, config: WorkerConfig, engine: Engine | None = None) -> None:
        self.config = config
        self.keys = Keys(config.namespace)
        self.model = config.model_name
        # Text is made on the publisher thread (TextStage), not in the engine loop.
        self.engine = engine or Engine(config.model_dir, **{**config.engine, "detokenize": False})
        self.client: redis.Redis = connect(config.redis_url)
        self.inflight = InflightTable(self.engine.config.max_num_seqs + config.prefetch)
        self.inbox: queue.Queue[Admission] = queue.Queue()
        text = TextStage(self.engine.tokenizer, lambda rid: self.loop.cancel(rid))
        self.publisher = Publisher(self.client, self.keys, config.worker_id, config.output_ttl_s,
                                   text)
        self.metrics = WorkerMetrics(self.model, config.worker_id, self.engine.stats)
        self.loop = EngineLoop(self.engine, self.inflight, self.inbox, self.publisher,
                               self.metrics, config.worker_id)
        self.intake = Intake(self.client, self.keys, self.model, config.worker_id, self.inflight,
                             self.inbox, self.publisher, self.engine.tokenizer,
                             config.read_block_ms, self.loop.cancel)
        self.leases = LeaseKeeper(self.client, config.worker_id, self.inflight, config.lease_ms,
                                  self.loop.drop)
        self.reaper = Reaper(self.client, self.keys, config.worker_id, self.intake, self.inflight,
                             config.lease_ms, config.max_deliveries,
                             # Often enough that a handed-back request moves at once.
                             interval_s=min(1.0, max(0.2, config.lease_ms / 2000)))
        self.cancels = CancelListener(self.client, self.keys, self.loop.cancel, config.worker_id)
        self.queue_poller = QueuePoller(self.client, self.keys, self.model, config.worker_id,
                                        self.metrics, config.queue_poll_interval_s)
        # The port /metrics is served on once started (None: not served).
        self.metrics_port: int | None = None
        self.heartbeat = Heartbeat(self.client, self.keys, config.worker_id,
                                   config.heartbeat_interval_s, self.status)
        self.state = "starting"
        self._started = time.monotonic()
        # (time, tokens generated) where the current tokens-per-second window began.
        self._rate_mark = (self._started, 0)
        self._stopped = threading.Event()

    def status(self) -> dict[str, Any]:
        """Load and progress, for the heartbeat and `conveyor top`."""
        stats = self.engine.stats()
        return {
            "status": self.state,
            "model": self.model,
            "running": stats["running"],
            "waiting": stats["waiting"],
            "swapped": stats.get("swapped", 0),
            "inflight": len(self.inflight),
            "kv_blocks_used": stats["kv_blocks_used"],
            "kv_blocks_total": stats["kv_blocks_total"],
            "tokens_generated": self.loop.tokens_generated,
            "tokens_per_s": self._tokens_per_s(),
            "steps": stats["steps"],
            "preemptions": stats.get("preemptions", 0),
            "metrics_port": self.metrics_port or "",
        }

    def _tokens_per_s(self) -> float:
        """Generation rate since the previous call at least a second ago (a heartbeat)."""
        now, tokens = time.monotonic(), self.loop.tokens_generated
        mark_t, mark_n = self._rate_mark
        rate = (tokens - mark_n) / max(1e-9, now - mark_t)
        if now - mark_t >= 1.0:
            self._rate_mark = (now, tokens)
        return round(rate, 1)

    def start(self) -> None:
        register_model(self.client, self.keys, self.model, self.engine, self.config.model_dir,
                       self.config.worker_id)
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.metrics_port,
                                                   self.config.metrics_host)
            self.queue_poller.start()
        self.state = "serving"
        self.heartbeat.beat()
        for thread in (self.publisher, self.loop, self.cancels, self.intake, self.heartbeat,
                       self.leases, self.reaper):
            thread.start()
        self.cancels.subscribed.wait(timeout=5)
        log.info("worker serving", worker_id=self.config.worker_id, model=self.model,
                 redis=describe(self.config.redis_url) if self.config.redis_url else "embedded",
                 metrics_port=self.metrics_port)

    def stop(self, drain_timeout_s: float | None = None) -> bool:
        """Stop reading, let in-flight requests finish (up to the drain timeout), then stop.

        Returns True when everything in flight finished. What is still unfinished has its
        published tokens flushed and is handed back (its lease made to look expired), so
        another worker claims it at once and continues after those tokens.
        """
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        self.state = "draining"
        for thread in (self.intake, self.reaper):
            thread.stopping.set()
            if thread.is_alive():
                thread.join()
        drained = self.inflight.wait_empty(timeout)
        self.loop.stopping.set()
        self.loop.join()
        self.publisher.close()
        self._hand_back_unfinished()
        for thread in (self.leases, self.cancels, self.heartbeat, self.queue_poller):
            thread.stopping.set()
            if thread.is_alive():
                thread.join()
        self.heartbeat.clear()
        self.metrics.close()
        self.state = "stopped"
        self._stopped.set()
        log.info("worker stopped", worker_id=self.config.worker_id, drained=drained)
        return drained

    def _hand_back_unfinished(self) -> None:
        left = [e for rid in self.inflight.ids() if (e := self.inflight.get(rid)) is not None]
        if not left:
            return
        try:
            hand_back(self.client, self.config.worker_id, [(e.stream, e.entry_id) for e in left],
                      self.config.lease_ms)
            log.info("handed back unfinished requests", count=len(left))
        except redis.RedisError as exc:  # they lapse with the lease instead
            log.warning("hand back failed; requests wait for their lease to lapse",
                        error=str(exc))

    def run_until_signalled(self) -> int:
        """Serve until SIGTERM or SIGINT, then drain; the exit status for the process."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        self.start()
        while not stop.wait(0.5):
            if not self.loop.is_alive():
                log.error("engine loop died", error=repr(self.loop.error))
                return 1
        self.stop()
        return 0
