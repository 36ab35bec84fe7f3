"""Many streamed answers at once through one gateway: all answered, and what the gateway adds
to the gap between chunks that a direct reader of the same streams sees.

    python -m worker.bench.gateway.streams [--streams 1000] [--tokens 100]
        [--simulate-step-ms 5] [--stream-interval-ms 50] [--max-num-seqs 1024]
        [--read-connections 8] [--ramp-s 0] [--no-direct]

A private redis-server, one simulated worker (`conveyor worker --simulate-step-ms`) and one
`conveyor gateway` process (worker/bench/gateway/processes.py); this process opens STREAMS
streaming completions at once (raw HTTP/1.1 on asyncio; with ``--ramp-s`` evenly over that
many seconds) while a process of its own follows the same requests' output streams directly
(the bench's follower, worker/bench/run/follower.py). Each chunk's arrival is timed on both
sides; the report gives every answer's status, the gaps between a request's chunks
p50/p90/p99 through the gateway and directly, /health's answers (asked every 0.5 s
throughout) and the CPU seconds of every process with the share of the machine's cores
they took together: past ~0.8 of them the processes wait for each other's cores, and the
gaps measure the machine as much as the gateway.
docs/benchmarks.md keeps the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _gaps(arrivals: list[float]) -> list[float]:
    return [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]


def measure(model_dir: Path, streams: int, tokens: int, step_ms: float, max_num_seqs: int,
            read_connections: int, out: Path, direct_too: bool = True,
            interval_ms: float | None = None, ramp_s: float = 0.0) -> dict[str, Any]:
    from worker.bench.gateway.processes import serving
    from worker.bench.run.cpu import process_cpu_s
    from worker.engine.config import field_default
    from worker.fleet.config import WorkerConfig

    flags = ["--simulate-step-ms", str(step_ms), "--max-num-seqs", str(max_num_seqs),
             "--max-num-batched-tokens", str(max(8192, max_num_seqs))]
    if interval_ms is not None:
        flags += ["--stream-interval-ms", str(interval_ms)]
    with serving(model_dir, out, flags, ["--max-concurrent", str(streams * 2),
                                         "--read-connections", str(read_connections)]) as run:
        cpu_before = {name: process_cpu_s(pid) or 0.0 for name, pid in run.pids.items()}
        interval = (field_default(WorkerConfig, "stream_interval_ms")
                    if interval_ms is None else interval_ms)
        result = asyncio.run(_drive(run.url, streams, tokens, run.redis_url, direct_too,
                                    interval, ramp_s, out / "arrivals.json"))
        cpu = result.pop("cpu_s")
        for name, pid in run.pids.items():
            cpu[name] = round((process_cpu_s(pid) or 0.0) - cpu_before[name], 2)
        result["cpu_s"] = cpu
        result["share_of_cores"] = round(sum(cpu.values()) / (
            (os.cpu_count() or 1) * result["seconds"]), 2)
    return {"streams": streams, "tokens": tokens, "simulate_step_ms": step_ms,
            "stream_interval_ms": interval_ms, "ramp_s": ramp_s,
            "read_connections": read_connections, **result}


def _read_directly(redis_url: str, interval_ms: float, rids: Any, report: Any) -> None:
    """The direct reader, a process of its own (the client's event loop and it would
    otherwise take turns at one interpreter): request ids come on ``rids`` (JSON), one
    ``null`` when no more will; it follows each to its final and sends back every request's
    chunk arrival times (JSON). A stream that just gave a chunk is left alone for the
    stream interval less 2 ms, as `conveyor bench` does (naming a thousand streams every
    poll would cost Redis more than the worker's writes)."""
    import redis

    from producer.wire.keys import Keys
    from worker.bench.run.follower import StreamFollower
    from worker.bench.run.runner_fleet import quiet_s

    follower = StreamFollower(redis.Redis.from_url(redis_url), Keys(), period_s=0.002,
                              quiet_s=quiet_s({"stream_interval_ms": interval_ms}))
    arrivals: dict[str, list[float]] = {}
    more = True
    while more or len(follower):
        while rids.poll():
            rid = json.loads(rids.recv_bytes())
            if rid is None:
                more = False
            else:
                follower.add(rid)
        events = follower.poll(20) if len(follower) else []
        now = time.perf_counter()
        for rid, event in events:
            # A chunk whose text is still held (a character's first bytes, a stop string's
            # start) makes no event of the gateway's: it is not one here either.
            if hasattr(event, "token_ids") and event.text:
                arrivals.setdefault(rid, []).append(now)
        if not events:
            time.sleep(0.002)
    report.send_bytes(json.dumps(arrivals).encode())


async def _drive(url: str, streams: int, tokens: int, redis_url: str, direct_too: bool,
                 interval_ms: float, ramp_s: float, arrivals_to: Path | None = None
                 ) -> dict[str, Any]:
    import multiprocessing

    import httpx

    from worker.bench.results.metrics import summarize_ms

    through: dict[str, list[float]] = {}
    statuses: list[int] = []
    done_ok = 0
    stop = threading.Event()
    spawn = multiprocessing.get_context("spawn")
    rids_out, rids_in = spawn.Pipe(duplex=False)
    report_out, report_in = spawn.Pipe(duplex=False)
    reader = spawn.Process(target=_read_directly, daemon=True,
                           args=(redis_url, interval_ms, rids_out, report_in))
    if direct_too:
        reader.start()
    health: list[int] = []

    def look() -> None:  # /health throughout: busy is not unhealthy
        with httpx.Client(timeout=10) as probe:
            while not stop.is_set():
                try:
                    health.append(probe.get(url + "/health").status_code)
                except httpx.TransportError:
                    health.append(0)
                stop.wait(0.5)

    prober = threading.Thread(target=look, daemon=True)
    prober.start()

    host, port = url.removeprefix("http://").split(":")

    async def one(i: int) -> None:
        # A lean HTTP/1.1 reader (an SSE event a chunk of the chunked answer): an HTTP client
        # library spends more CPU a chunk than the gateway does, and the client shares the
        # machine's cores with it.
        nonlocal done_ok
        await asyncio.sleep(ramp_s * i / streams)
        body = json.dumps({"model": "m", "prompt": [5, 6, 7, i % 50], "max_tokens": tokens,
                           "stream": True, "seed": i}).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        status = int((await reader.readline()).split()[1])
        statuses.append(status)
        rid = f"?{i}"
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "x-request-id":
                rid = value.strip()
        if direct_too:
            rids_in.send_bytes(json.dumps(rid).encode())
        times = through.setdefault(rid, [])
        last = b""
        while size := int((await reader.readline()).strip() or b"0", 16):
            event = await reader.readexactly(size)
            await reader.readline()  # the chunk's CRLF
            if event.startswith(b"data: {") and b'"text"' in event:
                times.append(time.perf_counter())
            if event.startswith(b"data:"):
                last = event
        writer.close()
        if last.strip() == b"data: [DONE]" and status == 200:
            done_ok += 1

    started, cpu_started = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(i) for i in range(streams)))
    elapsed = time.perf_counter() - started
    client_cpu = time.process_time() - cpu_started
    direct: dict[str, list[float]] = {}
    reader_cpu = 0.0
    if direct_too:
        from worker.bench.run.cpu import process_cpu_s

        rids_in.send_bytes(b"null")
        direct = json.loads(await asyncio.to_thread(report_out.recv_bytes))
        reader_cpu = process_cpu_s(reader.pid) or 0.0
        reader.join(10)
    stop.set()
    prober.join(15)
    if arrivals_to is not None:  # every chunk's arrival on both sides, to look into
        arrivals_to.write_text(json.dumps({"started": started, "through_gateway": through,
                                           "direct": direct}))
    gw = [g for times in through.values() for g in _gaps(times)]
    dr = [g for times in direct.values() for g in _gaps(times)]
    return {"seconds": round(elapsed, 2), "status_200": statuses.count(200),
            "answered_in_full": done_ok,
            "health_200": f"{health.count(200)} of {len(health)}",
            "gap_ms_through_gateway": summarize_ms(gw),
            "gap_ms_direct": summarize_ms(dr),
            "cpu_s": {"client": round(client_cpu, 2), "direct_reader": round(reader_cpu, 2)}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.bench.gateway.streams",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder (default: the small preset)")
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=100, help="output tokens a request")
    p.add_argument("--simulate-step-ms", type=float, default=5.0)
    p.add_argument("--stream-interval-ms", type=float, default=None,
                   help="the worker's (default: its own, 50)")
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--read-connections", type=int, default=8)
    p.add_argument("--ramp-s", type=float, default=0.0,
                   help="open the streams evenly over this many seconds (default: at once)")
    p.add_argument("--out", default=None,
                   help="folder for the processes' logs and every chunk's arrival times")
    p.add_argument("--no-direct", action="store_true",
                   help="no direct reader beside the gateway (this process then only reads "
                   "the answers)")
    args = p.parse_args(argv)
    from producer.gateway.server import raise_open_files_limit
    from producer.logging import configure_logging
    from worker.modelgen.ensure import ensure_model

    configure_logging("warning")
    raise_open_files_limit(args.streams + 64)  # this process holds a socket a stream
    out = Path(args.out or tempfile.mkdtemp(prefix="gateway-streams-"))
    out.mkdir(parents=True, exist_ok=True)
    result = measure(ensure_model(args.model, "small"), args.streams, args.tokens,
                     args.simulate_step_ms, args.max_num_seqs, args.read_connections, out,
                     not args.no_direct, args.stream_interval_ms, args.ramp_s)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
