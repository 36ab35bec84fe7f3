"""Run a workload through the real fleet: this process is the client, the worker a child process."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producer.client.client import Client
from producer.client.stream_events import ChunkEvent, FinalEvent
from worker.bench.results.metrics import bucket_quantile
from worker.bench.results.records import KVSample, RequestRecord, RunResult
from worker.bench.run import cpu
from worker.bench.run.arrivals import ArrivalPlan
from worker.bench.run.follower import StreamFollower
from worker.bench.run.worker_process import HEARTBEAT_INTERVAL_S, WorkerProcess
from worker.bench.run.workloads import WorkItem, possible_prefix_hits
from worker.engine.config import EngineConfig, field_default
from worker.host.cpu_placement import Placement

# How often the worker's heartbeat hash is read for the KV plot.
KV_SAMPLE_INTERVAL_S = 0.1
# Longest one XREAD waits, so arrivals, KV samples and a dead worker are noticed in time.
MAX_BLOCK_MS = 50
# A stream is looked at again this long before its next chunk can come (follower.py).
QUIET_MARGIN_S = 0.002


@dataclass
class FleetTarget:
    """Where and how the benchmarked worker runs."""

    model_dir: Path
    redis_url: str
    namespace: str
    # `conveyor worker` flags: engine settings and threads.
    worker_flags: list[str]
    log_dir: Path
    # More workers serving the same model, each with its flags (e.g. a decode worker
    # beside a prefill one); the first worker's heartbeat gives the KV samples.
    more_workers: tuple[tuple[str, ...], ...] = ()
    # Where the worker places its threads (None: it does not); the client, and Redis when
    # it is the bench's own, then run on its I/O CPUs for the measured run.
    placement: Placement | None = None
    own_redis: bool = False
    # Prefix affinity in the client (the workers' flags say theirs).
    affinity: bool = True


def run_fleet(name: str, target: FleetTarget, items: list[WorkItem],
              concurrency: int | None, settings: dict[str, Any], timeout_s: float,
              repeat: int = 0) -> RunResult:
    """Start a worker, warm it up, drive the workload through Redis, stop the worker."""
    label = f"{name}-{repeat}"
    model = f"bench-{os.getpid()}-{label}"  # its own request stream: no other worker serves it
    flags = [list(target.worker_flags), *(list(f) for f in target.more_workers)]
    with Client(target.redis_url, target.namespace, affinity=target.affinity) as client, \
            ExitStack() as stack:
        workers = [stack.enter_context(WorkerProcess(
            f"{label}-{i}" if i else label, target.model_dir, model, target.redis_url,
            target.namespace, f, target.log_dir / f"worker-{label}{f'-{i}' if i else ''}.log"))
            for i, f in enumerate(flags)]
        for w in workers:
            w.start(client.redis)
        group = _Group(workers)
        _warm_up(client, model, group)
        plan = ArrivalPlan(items, concurrency)
        time.sleep(2 * HEARTBEAT_INTERVAL_S)  # the warm-up's counters reach a heartbeat
        counted_before, tokens_before = _heartbeat_sums(client, workers)
        commands_before, reads_before = _commands(client), _reads_processed(client)
        delays_before = _publish_delays(workers)
        with _beside_the_worker(client, target):
            before = _cpu_now(client, workers)
            preempted_before = _over_workers(cpu.process_preemptions, workers)
            threads_before = [_threads(w) for w in workers]
            stolen_before, idle_before = cpu.stolen_cpu_s(), cpu.idle_cpu_s()
            records, kv, duration = _drive(client, model, items, plan, group, timeout_s,
                                           quiet_s(settings))
            stolen = cpu.delta(stolen_before, cpu.stolen_cpu_s())
            idle = cpu.idle_delta(idle_before, cpu.idle_cpu_s())
            after = _cpu_now(client, workers)
            threads = _summed_by_name(threads_before, [_threads(w) for w in workers])
        preempted = {"worker": cpu.delta(preempted_before,
                                         _over_workers(cpu.process_preemptions, workers))}
        used = {k: cpu.delta(v, after[k]) for k, v in before.items()}
        by_command = _commands(client) - commands_before
        commands = sum(by_command.values())
        round_trips = cpu.delta(reads_before, _reads_processed(client))
        build = _redis_build(client)
        delays = _delay_quantiles(delays_before, _publish_delays(workers))
        time.sleep(2 * HEARTBEAT_INTERVAL_S)  # the run's last counters reach a heartbeat
        counted_after, tokens_after = _heartbeat_sums(client, workers)
        counted = {k: v - counted_before[k] for k, v in counted_after.items()}
        tokens = [after - before for before, after in zip(tokens_before, tokens_after,
                                                          strict=True)]
        affinity_taken = int(counted.pop(AFFINITY_TAKEN))
        tier_hits = int(counted.pop(TIER_PREFIX_HITS))
        taken = {"worker": int(counted.pop(TAKEOVERS))}
        busy_ms = counted.pop(SIMULATED_BUSY)
        hits = int(counted.pop(PREFIX_HITS))
        moved = counted if len(workers) > 1 else {}
    waits = {}
    for w in workers:
        waits.update(w.queue_waits())
    run_waits = sorted(waits[r.request_id] for r in records if r.request_id in waits)
    where = "a worker process" if len(workers) == 1 else f"{len(workers)} worker processes"
    notes = [f"client in the bench process, {where}"]
    possible = possible_prefix_hits(items, field_default(EngineConfig, "block_size"))
    if possible:  # (a workload of shared prefixes: W6)
        notes.append(f"prefix cache hits: {hits} prompt tokens of {possible} possible "
                     f"({hits / possible:.2f}; possible: one shared cache that keeps every "
                     "prefix)" + (f"; {tier_hits} more fetched from the fleet KV tier"
                                  if tier_hits else ""))
    if len(workers) > 1:
        mean = sum(tokens) / len(tokens)
        notes.append(f"tokens per worker: {', '.join(str(int(t)) for t in tokens)} (the most "
                     f"{max(tokens) / mean if mean else 0:.2f}x the mean); prefix affinity "
                     f"{'on' if target.affinity else 'off'}, {affinity_taken} requests taken "
                     "from another worker's affinity lane")
    most = ", ".join(f"{name} {n / len(items):.2f}" for name, n in by_command.most_common(12))
    notes.append(f"Redis commands per request: {commands / len(items):.1f} (all clients, "
                 f"the workers' idle looks and heartbeats included; most: {most})")
    if round_trips is not None:
        # Each costs Redis a wake-up, a read and a write, whatever it carries (docs/redis.md).
        notes.append(f"Redis round trips per request: {round_trips / len(items):.2f} (reads "
                     f"of a client's commands, all clients; {build})")
    if delays is not None:
        notes.append("a step's output to Redis (conveyor_publish_delay_seconds, a bucket's "
                     "upper bound) p50/p90/p99 ms: <= " + "/".join(delays))
    if run_waits:
        notes.append("queue wait (created to admitted) p50/p90/p99 ms: " + "/".join(
            f"{run_waits[min(len(run_waits) - 1, int(q * len(run_waits)))]:.1f}"
            for q in (0.5, 0.9, 0.99)))
    if target.placement is not None:
        io = ",".join(map(str, sorted(target.placement.io)))
        notes.append(f"client{' and Redis' if target.own_redis else ''} on CPU {io}, the "
                     "worker's I/O CPUs")
    return RunResult(name, settings, records, duration, kv, used, preempted,
                     notes=notes, transfers=moved, taken_over=taken, stolen_s=stolen, idle_s=idle,
                     thread_cpu_s=threads,
                     simulated_busy_s=busy_ms / 1000 / len(workers) if busy_ms else None)


@contextmanager
def _beside_the_worker(client: Client, target: FleetTarget) -> Iterator[None]:
    """The calling thread (the client), and Redis when it is the bench's own, on the
    worker's I/O CPUs until the block ends; then back where they were."""
    if target.placement is None:
        yield
        return
    io = target.placement.io
    threads = [0]  # the calling thread
    if target.own_redis:
        pid = int(client.redis.info("server")["process_id"])
        threads += [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    before: dict[int, set[int]] = {}
    try:
        for t in threads:
            with suppress(OSError):  # a Redis thread that ended meanwhile
                before[t] = os.sched_getaffinity(t)
                os.sched_setaffinity(t, io)
        yield
    finally:
        for t, cpus in before.items():
            with suppress(OSError):
                os.sched_setaffinity(t, cpus)


TRANSFER_FIELDS = ("kv_put_bytes", "kv_put_s", "kv_put_count", "kv_get_bytes", "kv_get_s",
                   "kv_get_count", "kv_imported_tokens")
# Decode-step tasks a worker's master took over from a late thread (csrc/step_team.h).
TAKEOVERS = "step_team_takeovers"
# A simulated engine's milliseconds of steps (worker/engine/simulated.py).
SIMULATED_BUSY = "simulated_busy_ms"
# Prompt tokens the workers' prefix caches served.
PREFIX_HITS = "prefix_cache_hit_tokens"
# Requests taken from another worker's affinity lane (worker/fleet/affinity/takeover.py).
AFFINITY_TAKEN = "affinity_taken"
# Prompt tokens whose KV a worker fetched from the fleet tier (--kv-share-prefixes).
TIER_PREFIX_HITS = "kv_prefix_hit_tokens"


def _commands(client: Client) -> Counter[str]:
    """Commands the Redis server has run (INFO commandstats), by name, all clients
    together (calls inside scripts too)."""
    stats = client.redis.info("commandstats")
    return Counter({k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()
                    if isinstance(v, dict)})


# The workers' histogram of a step's output handed to their publisher until in Redis.
PUBLISH_DELAY = "conveyor_publish_delay_seconds"


def _publish_delays(workers: list[WorkerProcess]) -> dict[float, float] | None:
    """The workers' publish-delay buckets now, summed; None where one serves no metrics."""
    total: dict[float, float] = {}
    for w in workers:
        buckets = w.histogram_buckets(PUBLISH_DELAY)
        if buckets is None:
            return None
        for le, n in buckets.items():
            total[le] = total.get(le, 0.0) + n
    return total


def _delay_quantiles(before: dict[float, float] | None,
                     after: dict[float, float] | None) -> list[str] | None:
    """p50/p90/p99 of the publish delays counted in between, in ms (bucket bounds)."""
    if before is None or after is None:
        return None
    bounds = [bucket_quantile(before, after, q) for q in (0.5, 0.9, 0.99)]
    if None in bounds:
        return None
    return [f"{b * 1000:g}" for b in bounds]  # (inf: past the last bucket)


def _reads_processed(client: Client) -> int | None:
    """Reads of clients' commands Redis has done (INFO stats): its round trips, each one or
    more pipelined commands; None where INFO does not say (Redis < 6)."""
    value = client.redis.info("stats").get("total_reads_processed")
    return None if value is None else int(value)


def _redis_build(client: Client) -> str:
    """Redis's version and allocator: its CPU a token depends on both (docs/redis.md)."""
    version = client.redis.info("server").get("redis_version", "?")
    return f"Redis {version}, {client.redis.info('memory').get('mem_allocator', '?')}"


def _heartbeat_sums(client: Client, workers: list[WorkerProcess]
                    ) -> tuple[dict[str, float], list[float]]:
    """The workers' KV transfer counters, step take-overs, simulated steps' milliseconds,
    prefix cache hits and affinity take-overs (their heartbeats), summed; and the tokens
    each one generated, from the same read."""
    total = dict.fromkeys((*TRANSFER_FIELDS, TAKEOVERS, SIMULATED_BUSY, PREFIX_HITS,
                           AFFINITY_TAKEN, TIER_PREFIX_HITS), 0.0)
    tokens = []
    for w in workers:
        raw = client.redis.hgetall(w.key)
        for name in total:
            total[name] += float(raw.get(name.encode(), b"0") or 0)
        tokens.append(float(raw.get(b"tokens_generated", b"0") or 0))
    return total, tokens


class _Group:
    """The run's workers as one: any of them dead fails the run; the first one's heartbeat
    is sampled for KV use."""

    def __init__(self, workers: list[WorkerProcess]) -> None:
        self.workers = workers
        self.key = workers[0].key

    def check_alive(self) -> None:
        for w in self.workers:
            w.check_alive()


def _cpu_now(client: Client, workers: list[WorkerProcess]) -> dict[str, float | None]:
    return {"worker": _over_workers(cpu.process_cpu_s, workers),
            "client": time.process_time(), "redis": cpu.redis_cpu_s(client.redis)}


def _over_workers(measure: Callable[[int], float | None],
                  workers: list[WorkerProcess]) -> float | None:
    """``measure`` of each worker process, summed; None when one of them is unknown."""
    values = [measure(w.proc.pid) if w.proc else None for w in workers]
    return None if None in values else sum(values)  # type: ignore[arg-type]


def _threads(worker: WorkerProcess) -> dict[int, tuple[str, float]] | None:
    return cpu.thread_cpu_s(worker.proc.pid) if worker.proc else None


def _summed_by_name(before: list, after: list) -> dict[str, float]:
    """CPU seconds by thread name over the workers, summed, most first; empty where one is
    unknown."""
    total: dict[str, float] = {}
    for b, a in zip(before, after, strict=True):
        used = cpu.threads_delta(b, a)
        if used is None:
            return {}
        for name, seconds in used.items():
            total[name] = round(total.get(name, 0.0) + seconds, 3)
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def _warm_up(client: Client, model: str, worker: _Group) -> None:
    # First forwards allocate and pick kernels: keep that out of the measured run.
    ids = [client.submit(list(range(2, 2 + n)), model=model, max_tokens=4, temperature=0,
                         ignore_eos=True) for _ in worker.workers for n in (8, 64)]
    for rid in ids:
        worker.check_alive()
        client.result(rid, timeout=300)


def quiet_s(settings: dict[str, Any]) -> float:
    """How long after a chunk the follower leaves its stream alone: a stream's chunks come
    at most once a stream interval (none where a count of tokens may send them sooner)."""
    if settings.get("stream_interval"):
        return 0.0
    return max(0.0, (settings.get("stream_interval_ms") or 0) / 1000 - QUIET_MARGIN_S)


def _drive(client: Client, model: str, items: list[WorkItem], plan: ArrivalPlan,
           worker: _Group, timeout_s: float, quiet_s: float
           ) -> tuple[list[RequestRecord], list[KVSample], float]:
    follower = StreamFollower(client.redis, client.keys, quiet_s=quiet_s)
    records: dict[str, RequestRecord] = {}
    kv = _HeartbeatSampler(client, worker.key)
    start = time.perf_counter()
    kv.wall_start = time.time()
    max_seen, finished, next_check = 0, 0, 0.0
    while finished < len(items):
        now = time.perf_counter() - start
        due = plan.due(now, len(follower), max_seen)
        if due:
            for rid, i in _submit(client, model, items, due):
                records[rid] = RequestRecord.for_item(i, items[i], now)
                records[rid].request_id = rid
                follower.add(rid)
        if now >= next_check:
            worker.check_alive()
            kv.sample()
            next_check = now + KV_SAMPLE_INTERVAL_S
            if now > timeout_s:
                raise TimeoutError(f"the fleet run took over {timeout_s:.0f} s")
        wait = plan.seconds_to_next(now)
        if not len(follower):
            time.sleep(min(wait or 0.005, MAX_BLOCK_MS / 1000))
            continue
        block = MAX_BLOCK_MS if wait is None else min(MAX_BLOCK_MS, int(wait * 1000) + 1)
        events = follower.poll(block)
        t = time.perf_counter() - start
        for rid, event in events:
            rec = records[rid]
            if isinstance(event, ChunkEvent):
                rec.chunks.append((t, len(event.token_ids)))
                # The chunk's end is the tokens streamed so far (rec.output_tokens would sum
                # every chunk again at every event).
                max_seen = max(max_seen, event.index + len(event.token_ids))
            elif isinstance(event, FinalEvent):
                rec.finish_s, rec.finish_reason, rec.error = t, event.finish_reason, event.error
                finished += 1
    duration = time.perf_counter() - start
    kv.sample()
    return sorted(records.values(), key=lambda r: r.index), kv.samples, duration


def _submit(client: Client, model: str, items: list[WorkItem], due: list[int]
            ) -> list[tuple[str, int]]:
    """Enqueue the due requests in one round trip; (request id, workload index) of each."""
    pipe = client.redis.pipeline(transaction=False)
    ids = [client.submit(items[i].prompt_token_ids, model=model, pipeline=pipe,
                         max_tokens=items[i].max_tokens, temperature=0, ignore_eos=True)
           for i in due]
    pipe.execute()
    return list(zip(ids, due, strict=True))


class _HeartbeatSampler:
    """KV use over time from the worker's heartbeat hash (one sample per new heartbeat)."""

    def __init__(self, client: Client, key: str) -> None:
        self.client, self.key = client, key
        self.wall_start = time.time()
        self.samples: list[KVSample] = []
        self._last_ms = 0

    def sample(self) -> None:
        raw = {k.decode(): v.decode() for k, v in self.client.redis.hgetall(self.key).items()}
        updated = int(raw.get("updated_ms", 0))
        if not raw or updated == self._last_ms:
            return
        self._last_ms = updated
        self.samples.append(KVSample(max(0.0, updated / 1000 - self.wall_start),
                                     int(raw.get("kv_blocks_used", 0)),
                                     int(raw.get("kv_blocks_total", 0)),
                                     int(raw.get("running", 0)), int(raw.get("waiting", 0))))
