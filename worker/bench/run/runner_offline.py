"""Run a workload on the engine in this process, without Redis (the `--offline` alternative)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from producer.long_lived import long_lived_frozen
from worker.bench.results.records import KVSample, RequestRecord, RunResult
from worker.bench.run import cpu
from worker.bench.run.arrivals import ArrivalPlan
from worker.bench.run.workloads import WorkItem


def run_offline(model_dir: Path, items: list[WorkItem], concurrency: int | None,
                engine_settings: dict[str, Any], timeout_s: float) -> RunResult:
    """The same workload and arrivals as the fleet run, on an in-process Engine."""
    import torch

    from worker.engine.engine import Engine
    from worker.engine.memory import release_device_memory

    threads = torch.get_num_threads()
    engine = None
    try:
        engine = Engine(model_dir, **engine_settings)
        engine.generate([list(range(2, 10)), list(range(2, 66))],
                        {"max_tokens": 4, "temperature": 0, "ignore_eos": True})  # warm-up
        # As a worker process does once its engine is built (producer/long_lived.py).
        with long_lived_frozen():
            before, preempted_before = time.process_time(), cpu.process_preemptions(os.getpid())
            taken_before = engine.stats()["step_team_takeovers"]
            stolen_before, idle_before = cpu.stolen_cpu_s(), cpu.idle_cpu_s()
            records, kv, duration = _drive(engine, items, ArrivalPlan(items, concurrency),
                                           timeout_s)
            stolen = cpu.delta(stolen_before, cpu.stolen_cpu_s())
            idle = cpu.idle_delta(idle_before, cpu.idle_cpu_s())
            used = {"bench": round(time.process_time() - before, 3)}
            preempted = {"bench": cpu.delta(preempted_before,
                                            cpu.process_preemptions(os.getpid()))}
            taken = {"bench": engine.stats()["step_team_takeovers"] - taken_before}
    finally:
        torch.set_num_threads(threads)  # Engine(num_threads=...) changed it for this process
        if engine is not None:
            engine.close()
        del engine
        # A GPU engine's KV pool takes most of the GPU's free memory: a worker process the
        # next run starts must find it free, not in this process's cache.
        release_device_memory()
    return RunResult("offline", {"engine": engine_settings}, records, duration, kv, used,
                     preempted, notes=["engine in the bench process, no Redis"],
                     taken_over=taken, stolen_s=stolen, idle_s=idle)


def _drive(engine: Any, items: list[WorkItem], plan: ArrivalPlan, timeout_s: float
           ) -> tuple[list[RequestRecord], list[KVSample], float]:
    records: dict[str, RequestRecord] = {}
    kv: list[KVSample] = []
    start = time.perf_counter()
    max_seen, finished = 0, 0
    streamed: dict[str, int] = {}  # tokens each request produced so far
    while finished < len(items):
        now = time.perf_counter() - start
        in_flight = len(records) - finished
        for i in plan.due(now, in_flight, max_seen):
            rid = f"bench-{i}"
            engine.add_request(items[i].prompt_token_ids,
                               {"max_tokens": items[i].max_tokens, "temperature": 0,
                                "ignore_eos": True}, request_id=rid)
            records[rid] = RequestRecord.for_item(i, items[i], time.perf_counter() - start)
        if now > timeout_s:
            raise TimeoutError(f"the offline run took over {timeout_s:.0f} s")
        if not engine.has_unfinished():
            time.sleep(min(plan.seconds_to_next(now) or 0.001, 0.05))
            continue
        outputs = engine.step()
        t = time.perf_counter() - start
        kv.append(_kv_sample(engine, t))  # every step: stats() only reads counters
        for out in outputs:
            rec = records[out.request_id]
            if out.new_token_ids:
                rec.chunks.append((t, len(out.new_token_ids)))
                n = streamed[out.request_id] = streamed.get(out.request_id, 0) + len(
                    out.new_token_ids)
                max_seen = max(max_seen, n)
            if out.finished:
                rec.finish_s, rec.finish_reason = t, str(out.finish_reason)
                finished += 1
    duration = time.perf_counter() - start
    return sorted(records.values(), key=lambda r: r.index), kv, duration


def _kv_sample(engine: Any, t: float) -> KVSample:
    s = engine.stats()
    return KVSample(t, s["kv_blocks_used"], s["kv_blocks_total"], s["running"], s["waiting"])
