"""What a benchmark run records: per request, when its tokens arrived; per run, KV use over time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from worker.bench.run.workloads import WorkItem


@dataclass
class RequestRecord:
    """One request as the client saw it; times are seconds since the run started."""

    index: int
    group: str
    prompt_tokens: int
    max_tokens: int
    submit_s: float
    # (arrival time, tokens in it) of each output chunk, in order.
    chunks: list[tuple[float, int]] = field(default_factory=list)
    finish_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    request_id: str = ""

    @classmethod
    def for_item(cls, index: int, item: WorkItem, submit_s: float) -> RequestRecord:
        return cls(index, item.group, len(item.prompt_token_ids), item.max_tokens, submit_s)

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ok(self) -> bool:
        """Finished without an error and produced at least one token."""
        return self.finish_s is not None and self.error is None and bool(self.chunks)


@dataclass
class KVSample:
    """KV pool use at one moment (from a worker heartbeat or the offline engine's stats)."""

    t: float
    blocks_used: int
    blocks_total: int
    running: int = 0
    waiting: int = 0


@dataclass
class RunResult:
    """Everything one system measured on the workload."""

    # "fleet", "fleet-chunked-off", "offline" or "hf-static".
    name: str
    settings: dict[str, Any]
    records: list[RequestRecord]
    # From the run's start to the last request's finish.
    duration_s: float
    kv: list[KVSample] = field(default_factory=list)
    # CPU seconds used during the run, by process ("worker", "client", "redis", "bench").
    cpu_s: dict[str, float | None] = field(default_factory=dict)
    # Times the threads of the engine's process were preempted during the run ("worker" or
    # "bench": see worker.bench.run.cpu.process_preemptions).
    preempted: dict[str, float | None] = field(default_factory=dict)
    # Decode-step tasks the engine's master took over from a late thread during the run
    # (csrc/step_team.h), by process as ``preempted``.
    taken_over: dict[str, float | None] = field(default_factory=dict)
    # CPU seconds the worker's threads used during the run, by thread name (worker.bench.run.cpu.
    # threads_delta; the workers of a run summed); empty where unknown or not a fleet run.
    thread_cpu_s: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # CPU seconds the host took from this machine's CPUs during the run (worker.bench.run.cpu.
    # stolen_cpu_s), all CPUs together; None where unknown.
    stolen_s: float | None = None
    # Seconds each CPU sat idle during the run (worker.bench.run.cpu.idle_cpu_s); None where
    # unknown.
    idle_s: list[float] | None = None
    # Of a disaggregated run: KV moved through the tier during the run, summed over the
    # workers' heartbeats (kv_put_*/kv_get_* bytes, seconds, counts; kv_imported_tokens).
    transfers: dict[str, float] = field(default_factory=dict)
    # Of a simulated engine: seconds its steps took during the run (a worker's mean), the
    # time a GPU would have been busy; None for a real engine.
    simulated_busy_s: float | None = None
