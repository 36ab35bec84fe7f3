"""What the wire costs Redis: commands and CPU per generated token, per request, by command.

    python -m worker.bench.wire_commands [--model DIR] [--stream-interval-ms 50]
        [--simulate-step-ms 2] [--requests 64] [--tokens 150]

One worker (simulated steps by default, so the rate is a GPU's) serves REQUESTS requests of
TOKENS output tokens from a private redis-server, read by one client; Redis's own counters
(INFO commandstats, calls inside scripts included, INFO cpu, readers included, and the
bytes in and out of INFO stats) are read before and after. docs/redis.md keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any


def measure(model_dir: Path, interval_ms: float, step_ms: float | None, requests: int,
            tokens: int, max_num_seqs: int) -> dict[str, Any]:
    from producer.client.client import Client
    from producer.client.connection import connect
    from producer.redis.ephemeral import start_ephemeral
    from worker.fleet.config import WorkerConfig
    from worker.fleet.process import Worker

    engine: dict[str, Any] = {"max_num_seqs": max_num_seqs,
                              "num_kv_blocks": max_num_seqs * (tokens // 16 + 4)}
    if step_ms is not None:
        engine["simulate_step_ms"] = step_ms
    with tempfile.TemporaryDirectory() as folder:
        server = start_ephemeral(Path(folder))
        worker = Worker(WorkerConfig(model_dir=model_dir, served_model_name="m",
                                     redis_url=server.url, engine=engine,
                                     stream_interval_ms=interval_ms))
        try:
            worker.start()
            admin = connect(server.url)
            client = Client(server.url)
            admin.config_resetstat()
            cpu_before, net_before = admin.info("cpu"), admin.info("stats")
            started = time.monotonic()
            ids = [client.submit([5, 6, 7, 2 + i % 50], model="m", max_tokens=tokens,
                                 ignore_eos=True, seed=i) for i in range(requests)]
            for rid in ids:
                client.result(rid, timeout=600)
            elapsed = time.monotonic() - started
            stats = admin.info("commandstats")
            cpu_after, net_after = admin.info("cpu"), admin.info("stats")
        finally:
            worker.stop(drain_timeout_s=5)
            server.stop()
    made = requests * tokens
    calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
    cpu_s = sum(cpu_after[k] - cpu_before[k] for k in ("used_cpu_sys", "used_cpu_user"))
    return {
        "stream_interval_ms": interval_ms, "simulate_step_ms": step_ms,
        "requests": requests, "tokens": made, "seconds": round(elapsed, 3),
        "tokens_per_s": round(made / elapsed, 1),
        "commands_per_token": round(sum(calls.values()) / made, 4),
        "commands_per_request": round(sum(calls.values()) / requests, 2),
        "redis_cpu_us_per_token": round(cpu_s * 1e6 / made, 3),
        # Bytes Redis read (commands: mostly the chunks written) and wrote (replies: mostly
        # the chunks read), per token.
        **{f"bytes_{way}_per_token": round((net_after[f"total_net_{way}put_bytes"]
                                            - net_before[f"total_net_{way}put_bytes"]) / made, 1)
           for way in ("in", "out")},
        "per_request": {name: round(n / requests, 2)
                        for name, n in sorted(calls.items(), key=lambda kv: -kv[1])},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.bench.wire_commands",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder (default: the small preset)")
    p.add_argument("--stream-interval-ms", type=float, default=50.0)
    p.add_argument("--simulate-step-ms", type=float, default=2.0,
                   help="simulated step time; 0 runs the real model")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=150, help="output tokens per request")
    p.add_argument("--max-num-seqs", type=int, default=64)
    args = p.parse_args(argv)
    from producer.logging import configure_logging
    from worker.modelgen.ensure import ensure_model

    configure_logging("warning")  # the worker's info lines would bury the figures

    result = measure(ensure_model(args.model, "small"), args.stream_interval_ms,
                     args.simulate_step_ms or None, args.requests, args.tokens,
                     args.max_num_seqs)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
