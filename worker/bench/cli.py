"""`conveyor bench`: its arguments, and the run of the workload on the fleet and the asked-for
alternatives, then the report."""

from __future__ import annotations

import argparse
import heapq
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from worker.bench.results import limits, metrics, report
from worker.bench.results.plots import write_plots
from worker.bench.results.records import RunResult
from worker.bench.run import workloads
from worker.bench.run.systems import choose_systems
from worker.engine.config import EngineConfig, field_default
from worker.fleet.config import WorkerConfig


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` verb to the `conveyor` command's subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark the fleet on a reference workload, with plots and alternatives",
        description="Runs a reference workload (../shared/BENCHMARKS.md) through a worker "
        "process (this process is the client), reports throughput, TTFT/ITL/E2E percentiles "
        "and goodput, and writes results.json plus PNG plots. --baseline, --chunked-prefill "
        "off and --offline measure alternatives on the same model and workload in the same run.",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=["w1", "w2", "w3", "w5", "w6", "w7"], default="w1",
                   help="w1 heavy-tailed mix, w2 long-document burst, w3 shared document, "
                   "w5 documents arriving beside interactive requests, w6 documents x "
                   "questions (each question prefixed by its document, interleaved, Poisson "
                   "at 4 req/s unless --rate; prefix hits reported against the possible), "
                   "w7 steady decode at a GPU's rate (4,000 requests of 150-300 output "
                   "tokens; for --simulate-step-ms) (default: w1)")
    w.add_argument("--documents", type=int, default=None, metavar="D",
                   help="w6: documents (default 12; 3 with --quick, of 8 questions each)")
    w.add_argument("--doc-rate", type=float, default=0.5, metavar="R",
                   help="w5: long documents arriving per second (default: %(default)s)")
    w.add_argument("--requests", type=int, default=None, metavar="N",
                   help="requests (w1), steady requests (w2), questions (w3) or questions "
                   "per document (w6); default: the workload's own (64, 48, 16, 6)")
    arrivals = w.add_mutually_exclusive_group()
    arrivals.add_argument("--rate", type=float, default=None, metavar="R",
                          help="Poisson arrivals at R requests/s (default: all at t=0)")
    arrivals.add_argument("--concurrency", type=int, default=None, metavar="C",
                          help="keep C requests in flight (default: all at t=0)")
    w.add_argument("--seed", type=int, default=0,
                   help="seed of the workload's prompts, lengths and arrivals")
    w.add_argument("--quick", action="store_true",
                   help="tiny model and a few short requests: a smoke run of seconds")

    s = p.add_argument_group("system")
    s.add_argument("--model", help="checkpoint folder (default: the small preset, or tiny with "
                   "--quick; made if missing)")
    s.add_argument("--redis", metavar="URL", default=None,
                   help="Redis to use (default: a private redis-server started for the run)")
    s.add_argument("--redis-server", metavar="PATH", default=None,
                   help="the redis-server the private Redis runs, a file or a name on PATH "
                   "(default: the bundled Redis 6.2, else redis-server on PATH); its CPU a "
                   "token depends on it (docs/redis.md)")
    s.add_argument("--namespace", default="conveyor",
                   help="prefix of every conveyor key: the fleet's namespace")
    s.add_argument("--threads", type=int, default=2,
                   help="torch threads of the worker, the offline engine and hf-static (default 2)")
    s.add_argument("--workers", type=int, default=1, metavar="N",
                   help="worker processes of the fleet, each with --threads threads "
                   "(default 1)")
    s.add_argument("--place-threads", action=argparse.BooleanOptionalAction, default=True,
                   help="a single worker pins its threads where its engine's fill the CPUs, and "
                   "the client and the bench's own Redis run on its I/O CPUs "
                   "(worker/host/cpu_placement.py; default: on)")
    sim = s.add_mutually_exclusive_group()
    sim.add_argument("--simulate-step-ms", type=float, default=None, metavar="MS",
                     help="SIMULATED workers (and offline engine): no forward, each step MS "
                     "ms, tokens a function of each seed: the fleet at a GPU's speed "
                     "(worker/engine/simulated.py); results say so")
    sim.add_argument("--simulate-cost", default=None, metavar="FILE|PRESET",
                     help="the same, steps costed by a JSON file or a preset (h200-8b)")
    s.add_argument("--max-num-seqs", type=int, default=field_default(EngineConfig, "max_num_seqs"),
                   help="requests a worker runs at once")
    s.add_argument("--max-num-batched-tokens", type=int,
                   default=field_default(EngineConfig, "max_num_batched_tokens"),
                   help="token budget of a step")
    s.add_argument("--num-kv-blocks", type=int, default=None,
                   help="device KV pool in blocks (default: the engine's sizing)")
    s.add_argument("--max-prefill-chunk", type=int, default=None, metavar="N",
                   help="cap on one request's prefill chunk in a step (default: the budget)")
    s.add_argument("--attention-backend", choices=["auto", "torch", "paged"], default="auto",
                   help="the workers' and offline engine's attention (their "
                   "--attention-backend; default: %(default)s)")
    s.add_argument("--enforce-eager", action="store_true",
                   help="the workers and offline engine capture no CUDA graphs")
    s.add_argument("--itl-target-ms", type=float, default=None, metavar="MS",
                   help="the workers size each step's prefill to this inter-token target "
                   "while requests decode (default: off)")
    s.add_argument("--stream-interval-ms", type=float,
                   default=field_default(WorkerConfig, "stream_interval_ms"), metavar="MS",
                   help="the workers publish a decoding request's tokens at most once every "
                   "MS ms; 0: every step (default: %(default)s)")
    s.add_argument("--stream-interval", type=int, default=None, metavar="N",
                   help="deprecated: the workers also publish a request's held tokens once "
                   "they number N")

    a = p.add_argument_group("alternatives, measured after the fleet run")
    a.add_argument("--baseline", choices=["hf-static", "hf-cb"], nargs="+", default=None,
                   help="transformers on the engine's device and dtype, all requests at t=0: "
                   "hf-static, generate in static padded batches; hf-cb, its continuous "
                   "batching (generate_batch); one or both (default: no baseline)")
    a.add_argument("--hf-batch-size", type=int, default=16,
                   help="--baseline hf-static: requests per static batch")
    a.add_argument("--chunked-prefill", choices=["on", "off"], default="on",
                   help="off: also run the fleet with chunked prefill off, for comparison")
    s.add_argument("--kv-share-prefixes", action="store_true",
                   help="the workers share prompt blocks through the fleet KV tier (their "
                   "--kv-share-prefixes; a real engine only): the KV goes to the request "
                   "where prefix affinity could not bring the request to the KV")
    a.add_argument("--plain-pull", action="store_true",
                   help="also run the fleet without prefix affinity (workers and client "
                   "--no-affinity: whichever worker reads first serves), for comparison")
    a.add_argument("--offline", action="store_true",
                   help="also run the engine in this process without Redis")
    a.add_argument("--disaggregate", action="store_true",
                   help="instead of the fleet: two mixed workers against one prefill and one "
                   "decode worker, each with --threads threads (prefill/decode disaggregation)")

    a.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run every system N times, in turns, and report each one's median "
                   "(steadier ratios on a machine other work shares)")

    o = p.add_argument_group("output")
    o.add_argument("--slo-ttft-ms", type=float, default=2000.0,
                   help="TTFT objective for goodput (default 2000)")
    o.add_argument("--slo-itl-ms", type=float, default=100.0,
                   help="objective on each request's mean inter-token latency (default 100)")
    o.add_argument("--out", metavar="DIR", default=None,
                   help="results folder (default: ./bench-results/TIMESTAMP)")
    o.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds one run may take before the bench gives up")
    p.set_defaults(handler=bench_cmd)
    return p


def bench_cmd(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed arguments describe; writes results.json and plots."""
    from worker.host.cpu_kernels import cpu_kernels
    from worker.modelgen.ensure import ensure_model

    _check(args)
    cpu_kernels()  # built before any worker starts: none measures the torch path meanwhile
    model_dir = ensure_model(args.model, "tiny" if args.quick else "small")
    config = json.loads((model_dir / "config.json").read_text())
    items = workloads.build_workload(args.workload, args.requests, config["vocab_size"],
                                     args.seed, args.quick, args.doc_rate, args.documents)
    if args.rate:
        items = workloads.with_poisson_arrivals(items, args.rate, args.seed)
    out_dir = Path(args.out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()

    runs: dict[str, list[RunResult]] = {}
    with _exit_on_sigterm(), _redis(args.redis, args.redis_server) as redis_url:
        systems = choose_systems(args, model_dir, config, items, redis_url, out_dir)
        # The machine's limits, right before the runs and at their thread count (and again
        # right after them: the better of each pair counts, limits.py says why).
        device = limits.limits_device(simulated_ideal(args, items) is not None)
        weight_bytes = limits.model_size(config, limits.weight_bytes_on(device)).weight_bytes
        before = limits.measure_peaks(args.threads, weight_bytes, device)
        _say(f"limits before the runs: GEMM {before.as_dict()['gemm_gflops']} GFLOP/s, copy "
             f"{before.as_dict()['copy_gb_per_s']} GB/s")
        # Round robin: load from other processes lands on every system alike.
        for repeat in range(args.repeat):
            for system in systems:
                _say(f"[{repeat + 1}/{args.repeat}] {system.name}: {len(items)} requests, "
                     f"{system.describe} ...")
                run = system.run(repeat)
                runs.setdefault(system.name, []).append(run)
                tput = metrics.throughput(run.records, run.duration_s)
                _say(f"  {tput['output_tokens_per_s']:.1f} output tokens/s, "
                     f"{run.duration_s:.1f} s")
        after = limits.measure_peaks(args.threads, weight_bytes, device)
        limits_found = limits.limit_report(config, before.best(after), workloads.describe(items),
                                           measured=[before, after], device=device)
        _say(f"limits after the runs: GEMM {after.as_dict()['gemm_gflops']} GFLOP/s, copy "
             f"{after.as_dict()['copy_gb_per_s']} GB/s; with the better of each, the "
             f"workload's physical limit is {limits_found['limit_output_tokens_per_s']} output "
             "tokens/s")

    slo = metrics.SLO(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000)
    chosen = {name: _median_run(repeats) for name, repeats in runs.items()}
    summaries = {}
    for name, run in chosen.items():
        summaries[name] = metrics.summarize_run(run, slo)
        summaries[name]["repeats"] = [_repeat_row(r) for r in runs[name]]
    rows = report.comparisons(summaries, args.workload, aims=not args.quick)
    simulated = simulated_ideal(args, items)
    if simulated is not None:
        # The machine's limits mean nothing to simulated steps: their own ideal does.
        rows += report.simulated_rows(summaries, simulated)
    elif not (args.rate or args.concurrency or any(i.arrival_s for i in items)):
        # The limit assumes everything at t=0.
        rows += report.limit_rows(summaries, limits_found["limit_output_tokens_per_s"],
                                  args.workload, aims=not args.quick)
    title = f"{args.workload} on {model_dir.name}, {_arrivals(args)}"
    plots = write_plots(list(chosen.values()), out_dir, title)
    load_after = os.getloadavg()
    results = {
        "conveyor_bench": 1,
        "arguments": {k: v for k, v in vars(args).items() if k not in ("command", "handler")},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workload": {"name": args.workload, "arrivals": _arrivals(args), "seed": args.seed,
                     "quick": args.quick, **workloads.describe(items)},
        "model": {"dir": str(model_dir), "name": model_dir.name},
        "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms,
                "itl_applies_to": "each request's mean inter-token latency (TPOT)"},
        "host": {"cpus": os.cpu_count(), "load_before": list(load_before),
                 "load_after": list(load_after)},
        "limits": limits_found,
        "simulated": simulated,
        "runs": summaries,
        "comparisons": rows,
        "requests": {run.name: metrics.request_rows(run.records) for run in chosen.values()},
        "plots": plots,
    }
    report.write_json(results, out_dir / "results.json")
    _print(summaries, rows, load_before, load_after, out_dir, plots, args.repeat)
    return 0


def simulated_ideal(args: argparse.Namespace, items: list) -> dict[str, Any] | None:
    """For a simulated engine: its step cost, the output tokens/s its steps allow at full
    batch (every step decodes --max-num-seqs rows, each reading the workload's mean
    context), and the best any engine reaches on this workload; None for a real one."""
    from worker.engine.simulated import StepCost, step_cost

    cost = step_cost(args.simulate_step_ms, args.simulate_cost)
    if cost is None:
        return None
    rows = args.max_num_seqs
    context = sum(len(i.prompt_token_ids) + i.max_tokens / 2 for i in items) / max(1, len(items))
    step_ms = cost.step_ms(prefill_tokens=0, decode_rows=rows, context_tokens=rows * context)
    ideal = {"step_cost": cost.to_dict(), "full_batch_step_ms": round(step_ms, 4),
             "ideal_output_tokens_per_s": round(rows * 1000 / step_ms, 1)}
    # The best any engine does, where it is a bound: every step costs the same (`a` alone)
    # and every request is there at t=0.
    if (cost == StepCost(base_ms=cost.base_ms) and not args.rate
            and not args.concurrency and not any(i.arrival_s for i in items)):
        steps = perfect_engine_steps([i.max_tokens for i in items], rows)
        ideal["best_output_tokens_per_s"] = round(
            sum(i.max_tokens for i in items) * 1000 / (max(1, steps) * step_ms), 1)
    return ideal


def perfect_engine_steps(output_tokens: list[int], rows: int) -> int:
    """Steps an engine with ``rows`` slots needs when each request takes one slot for its
    output tokens' steps and a freed slot takes the next request in the same step: the
    best any engine does; the ideal's full batches less the last requests' drain."""
    ends = [0] * rows
    for n in output_tokens:  # in arrival order, each to the slot that frees first
        heapq.heappush(ends, heapq.heappop(ends) + n)
    return max(ends)


def _median_run(repeats: list[RunResult]) -> RunResult:
    """The repeat of median output throughput (the faster middle one of an even count)."""
    ranked = sorted(repeats, key=lambda r: sum(x.output_tokens for x in r.records) / r.duration_s)
    return ranked[len(ranked) // 2]


def _repeat_row(run: RunResult) -> dict[str, Any]:
    return {"duration_s": round(run.duration_s, 3),
            **metrics.throughput(run.records, run.duration_s), "cpu_s": run.cpu_s,
            "preempted": run.preempted, "taken_over": run.taken_over, "stolen_s": run.stolen_s,
            "idle_s": run.idle_s, "thread_cpu_s": run.thread_cpu_s}


def _print(summaries: dict[str, Any], rows: list[dict[str, Any]], load_before: tuple,
           load_after: tuple, out_dir: Path, plots: list[str], repeats: int) -> None:
    if repeats > 1:
        print(f"each run: the median of {repeats} repeats by output tokens/s")
    print(report.format_runs(summaries))
    print(report.format_cpu(summaries))
    if repeats > 1:
        print(report.format_repeats(summaries))
    if rows:
        print()
        print(report.format_comparisons(rows))
    if note := report.format_steal_note(summaries):
        print(note)
    print(f"\nload average (1/5/15 min) before {_load(load_before)}, after {_load(load_after)} "
          f"({os.cpu_count()} CPUs)")
    print(f"results: {out_dir / 'results.json'}; plots: {', '.join(plots)}")


def _check(args: argparse.Namespace) -> None:
    for name in ("requests", "concurrency", "hf_batch_size", "threads", "repeat", "workers",
                 "documents"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.rate is not None and args.rate <= 0:
        raise ValueError(f"--rate must be > 0, got {args.rate}")
    if args.workers > 1 and getattr(args, "disaggregate", False):
        raise ValueError("--workers and --disaggregate each choose the fleet's workers: "
                         "give one")
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a file: give a folder for the results")
    if args.redis_server is not None:
        if args.redis:
            raise ValueError("--redis-server is the binary of the private Redis the bench "
                             "starts: not with --redis")
        found = shutil.which(args.redis_server)  # a path, or a name on PATH
        if found is None or not os.path.isfile(found):
            raise ValueError(f"--redis-server {args.redis_server} is not an executable file "
                             "(nor one on PATH)")
        args.redis_server = found


@contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """SIGTERM ends the bench like Ctrl-C: the worker and Redis it started are stopped too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _redis(url: str | None, binary: str | None = None) -> Iterator[str]:
    """The given Redis, or a private redis-server for this run (no persistence; ``binary``,
    or the one found), stopped after."""
    if url:
        yield url
        return
    from producer.redis.server import start_ephemeral

    with tempfile.TemporaryDirectory(prefix="conveyor-bench-") as tmp:
        with start_ephemeral(Path(tmp), binary=binary, appendonly="no") as server:
            yield server.url


def _arrivals(args: argparse.Namespace) -> str:
    if args.workload == "w5":
        return f"interactive at t=0, documents at {args.doc_rate:g}/s"
    if args.rate:
        return f"Poisson arrivals at {args.rate:g} req/s"
    if args.concurrency:
        return f"concurrency {args.concurrency}"
    return "all at t=0"


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{v:.2f}" for v in avg)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
