"""Settings of one worker process, each with its default and meaning."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producer import settings
from producer.defaults import MAX_BLOCK_MS
from producer.wire.keys import validate_name
from worker.engine.config import EngineConfig

# What a worker does with a request (docs/kv-tier.md, "Roles").
ROLES = ("both", "prefill", "decode")


def default_worker_id() -> str:
    # Host and pid: unique per process, and readable in `conveyor top`.
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40]
    return f"{host or 'worker'}-{os.getpid()}"


# The default prefetch's least (a CPU worker's 64 seats get this; a decode worker always).
MIN_PREFETCH = 8


@dataclass
class WorkerConfig:
    """What a worker serves, where, and how much it takes on."""

    model_dir: Path
    # The name producers address; defaults to the model folder's name.
    served_model_name: str | None = None
    # Redis URL; None means the embedded server.
    redis_url: str | None = None
    namespace: str = "conveyor"
    worker_id: str = field(default_factory=default_worker_id)
    # Engine settings (any EngineConfig field).
    engine: dict[str, Any] = field(default_factory=dict)
    # Requests read beyond what the engine runs at once, so the next step never starves;
    # the intake reads once half of it is free. None: a sixteenth of the engine's seats, at
    # least 8 (a GPU's batch of 256 ends ~200 requests a second: reads of 4 would cost
    # Redis a round trip or more a request; docs/redis.md); 8 on a decode worker.
    prefetch: int | None = None
    # Longest a blocking read waits before the intake re-checks its room and stop flag.
    read_block_ms: int = 1000
    # Output streams live this long after their last write (renewed on every write).
    output_ttl_s: int = 3600
    # A decoding request's tokens go out at most once this many ms (its first token and its
    # final at once; every token where they come slower): a bounded number of writes for
    # Redis and the clients whatever the step rate, each token up to this much later
    # (worker/fleet/publishing/chunk_holder.py). 0: every step.
    stream_interval_ms: float = 50.0
    # Deprecated (a count of steps means nothing to a reader at an unknown step rate): also
    # send a request's held tokens once they number this many. None: by time alone.
    stream_interval: int | None = None
    heartbeat_interval_s: float = 2.0
    # How often the reaper does its housekeeping: trims served entries (those below the
    # oldest pending one) off the request streams (until then they can be read back with
    # XRANGE), removes dead workers' consumers and stale entries of the worker set, and
    # checks for lanes closed to new requests.
    housekeeping_interval_s: float = 30.0
    # On SIGTERM, how long in-flight requests may take to finish; the rest is handed back.
    drain_timeout_s: float = 30.0
    # An in-flight entry not renewed for this long belongs to a dead worker and is claimed.
    lease_ms: int = 30_000
    # A request delivered more often than this keeps killing workers: dead-lettered.
    max_deliveries: int = 5
    # Serve Prometheus metrics on this port (0: any free port, see Worker.metrics_port);
    # None: not served.
    metrics_port: int | None = None
    # Address the metrics server binds (all interfaces: Prometheus scrapes from elsewhere).
    metrics_host: str = "0.0.0.0"
    # How often the lane depth and pending gauges are read from Redis while metrics are served.
    queue_poll_interval_s: float = 2.0
    # Serve even when Redis may evict keys (maxmemory-policy other than noeviction): an
    # evicted request stream takes its consumer group and every request in it along.
    allow_eviction: bool = False
    # How long a Python thread may keep the GIL while another waits for it, set for the
    # whole process by `conveyor worker` (None: keep Python's 5 ms). The engine thread
    # needs the GIL between its torch ops; with Python's 5 ms it waited that long whenever
    # the publisher or intake thread was encoding (docs/benchmarks.md, "Fleet vs `--offline`
    # throughput").
    gil_switch_interval_s: float | None = 0.0005
    # Run the worker's I/O threads (intake, publisher, leases, heartbeat...) under
    # SCHED_BATCH, so that waking up they never preempt the engine's computing threads
    # (worker/host/thread_policy.py; docs/benchmarks.md, "Fleet vs `--offline` throughput").
    batch_io_threads: bool = True
    # ... but not the publisher: it wakes when the engine loop hands it a step's output,
    # that is while the loop's own Python runs between two steps and the OpenMP partner
    # only waits for it; taking the partner's core then costs the engine nothing it uses,
    # where under SCHED_BATCH the publisher ran a few ms later, in the middle of the next
    # step (docs/benchmarks.md, "Fleet vs `--offline` throughput").
    # CONVEYOR_BATCH_PUBLISHER=1 puts it under SCHED_BATCH too (to compare).
    batch_publisher: bool = field(
        default_factory=settings.batch_publisher)
    # On a CPU engine whose one or two OpenMP threads fill the process's CPUs (one to spare
    # at most), pin each to a CPU of its own and the I/O threads beside the last
    # (worker/host/cpu_placement.py). Off by default here, where several workers may share a
    # process (tests, embedding); `conveyor worker` turns it on (--no-place-threads: off).
    place_threads: bool = False
    # prefill: compute prompts and hand requests on after their first token; decode: take
    # handed-on requests only; both: serve whole requests, and take handed-on ones too.
    role: str = "both"
    # The fleet KV tier's Redis (None: the queues' Redis; its own is the production choice).
    kv_redis_url: str | None = None
    kv_ttl_s: int = 600
    kv_max_bytes: int = 256 * 1024 * 1024
    # Seconds one round trip to the KV tier (at most a chunk, 512 KiB) may take before the
    # tier is skipped for kv_breaker_open_s (kvstore/tier/breaker.py): a tier that stops
    # answering costs a request at most this, never the worker its other requests.
    kv_timeout_s: float = 1.0
    kv_breaker_open_s: float = 30.0
    # Tier transfers waiting on the worker's tier threads before new ones go on without
    # the tier (worker/fleet/handoff/tier_io.py).
    kv_queue: int = 64
    # A prefill worker reads no new request while this many wait in its model's handoff
    # streams (decode workers fall behind): prompts computed far ahead would only wait, their
    # KV filling the tier and expiring there. None: no bound.
    handoff_max_waiting: int | None = 64
    # Fleet-wide prefix reuse: put computed prompt blocks in the KV tier, and look a new
    # request's blocks up there when this worker's own prefix cache misses.
    kv_share_prefixes: bool = False
    # Prefix affinity (worker/fleet/affinity/): read an affinity lane of its own and
    # advertise the prefixes it serves, so requests sharing them come here. Off: it reads
    # the shared lanes only (it still takes over other workers' waiting requests).
    affinity: bool = True
    # Milliseconds a request waits in a live worker's affinity lane before an idle worker
    # takes it over (recomputing its prefix beats waiting for a busy owner).
    affinity_delay_ms: int = 250

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name

    def __post_init__(self) -> None:
        # Every setting is checked here, once, whoever built the config (CLI, tests, code).
        validate_name("namespace", self.namespace)
        validate_name("worker id", self.worker_id)
        if self.served_model_name is not None:
            validate_name("model", self.served_model_name)
        EngineConfig.from_kwargs(self.engine)  # unknown or invalid engine settings
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        _at_least("kv_ttl_s", self.kv_ttl_s, 1)
        _at_least("kv_max_bytes", self.kv_max_bytes, 1)
        _at_least("kv_queue", self.kv_queue, 1)
        for name in ("kv_timeout_s", "kv_breaker_open_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.prefetch is not None:
            _at_least("prefetch", self.prefetch, 0)
        _at_least("affinity_delay_ms", self.affinity_delay_ms, 0)
        if self.handoff_max_waiting is not None:
            _at_least("handoff_max_waiting", self.handoff_max_waiting, 1)
        _at_least("output_ttl_s", self.output_ttl_s, 1)
        if self.stream_interval is not None:
            _at_least("stream_interval", self.stream_interval, 1)
        _at_least("stream_interval_ms", self.stream_interval_ms, 0)
        _at_least("lease_ms", self.lease_ms, 1)
        _at_least("max_deliveries", self.max_deliveries, 1)
        _at_least("drain_timeout_s", self.drain_timeout_s, 0)
        if self.gil_switch_interval_s is not None and not self.gil_switch_interval_s > 0:
            raise ValueError("gil_switch_interval_s must be > 0 or None, "
                             f"got {self.gil_switch_interval_s!r}")
        for name in ("heartbeat_interval_s", "queue_poll_interval_s", "housekeeping_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        # A blocking read longer than this would outlast the socket timeout.
        if not 1 <= self.read_block_ms <= MAX_BLOCK_MS:
            raise ValueError(f"read_block_ms must be in [1, {MAX_BLOCK_MS}], "
                             f"got {self.read_block_ms!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port!r}")

    def prefetch_for(self, max_num_seqs: int) -> int:
        """The prefetch of a worker with ``max_num_seqs`` seats: ``prefetch``, or by default
        a sixteenth of the seats and at least MIN_PREFETCH.

        Not more: the requests it holds wait for a seat, up to a prefetch's worth of ends
        (~80 ms for 16 at ~200 ends a second), and a worker whose oldest waits half the
        affinity delay is busy (worker/fleet/affinity/busy.py). A decode worker keeps
        MIN_PREFETCH: a handed-on request's KV takes blocks as soon as it is added."""
        if self.prefetch is not None:
            return self.prefetch
        if self.role == "decode":
            return MIN_PREFETCH
        return max(MIN_PREFETCH, max_num_seqs // 16)


def _at_least(name: str, value: Any, low: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < low:
        raise ValueError(f"{name} must be a number >= {low}, got {value!r}")
