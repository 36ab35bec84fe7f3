"""argparse wiring for `conveyor bench` (the handler is in worker.bench, imported when it runs)."""

from __future__ import annotations

import argparse
from typing import Any


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
    w.add_argument("--workload", choices=["w1", "w2", "w3"], default="w1",
                   help="w1 heavy-tailed mix, w2 long-document burst, w3 shared document "
                   "(default: w1)")
    w.add_argument("--requests", type=int, default=None, metavar="N",
                   help="requests (w1), steady requests (w2) or questions (w3); default: the "
                   "workload's own (64, 48, 16)")
    arrivals = w.add_mutually_exclusive_group()
    arrivals.add_argument("--rate", type=float, default=None, metavar="R",
                          help="Poisson arrivals at R requests/s (default: all at t=0)")
    arrivals.add_argument("--concurrency", type=int, default=None, metavar="C",
                          help="keep C requests in flight (default: all at t=0)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--quick", action="store_true",
                   help="tiny model and a few short requests: a smoke run of seconds")

    s = p.add_argument_group("system")
    s.add_argument("--model", help="checkpoint folder (default: the small preset, or tiny with "
                   "--quick; made if missing)")
    s.add_argument("--redis", metavar="URL", default=None,
                   help="Redis to use (default: a private redis-server started for the run)")
    s.add_argument("--namespace", default="conveyor")
    s.add_argument("--threads", type=int, default=2,
                   help="torch threads of the worker, the offline engine and hf-static (default 2)")
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--max-num-batched-tokens", type=int, default=1024)
    s.add_argument("--num-kv-blocks", type=int, default=None)
    s.add_argument("--max-prefill-chunk", type=int, default=None)

    a = p.add_argument_group("alternatives, measured after the fleet run")
    a.add_argument("--baseline", choices=["hf-static"], default=None,
                   help="transformers generate in static padded batches (all requests at t=0)")
    a.add_argument("--hf-batch-size", type=int, default=16)
    a.add_argument("--chunked-prefill", choices=["on", "off"], default="on",
                   help="off: also run the fleet with chunked prefill off, for comparison")
    a.add_argument("--offline", action="store_true",
                   help="also run the engine in this process without Redis")

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
    return p
