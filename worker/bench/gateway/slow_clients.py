"""Slow clients against one gateway: hundreds that never finish their headers and hundreds
that send one byte of a large body hold their sockets open, while a normal client asks for
an answer; then the gateway's timeouts close every slow one.

    python -m worker.bench.gateway.slow_clients [--slow-headers 600] [--slow-bodies 600]
        [--header-timeout 10] [--body-timeout 30]

A private redis-server, one simulated worker and one `conveyor gateway` process at its
default settings but the two timeouts (worker/bench/gateway/processes.py). Once the gateway
counts every slow connection open (and the slow bodies being read, each one's concurrency
slot not taken), this process sends one normal completion and times its answer; then it
reads every slow socket until the gateway closes it. The report: the normal answer's status
and seconds, how many slow connections were closed and how (no answer for the headers that
never ended, 408 body_timeout for the bodies), when the last closed, the gateway's own
counts (`conveyor_gateway_timeouts_total`) and its CPU. docs/benchmarks.md keeps the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

# How long a slow connection may stay open past its timeout before the run says it was not
# closed.
CLOSE_MARGIN_S = 30.0
HEADERS_NEVER_ENDING = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n"
BODY_NEVER_ENDING = (b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100000\r\n\r\n{")


def measure(model_dir: Path, slow_headers: int, slow_bodies: int, header_timeout_s: float,
            body_timeout_s: float, out: Path) -> dict[str, Any]:
    from worker.bench.gateway.processes import serving
    from worker.bench.run.cpu import process_cpu_s

    flags = ["--header-timeout", str(header_timeout_s), "--body-timeout", str(body_timeout_s)]
    with serving(model_dir, out, ["--simulate-step-ms", "5"], flags) as run:
        cpu_before = process_cpu_s(run.pids["gateway"]) or 0.0
        result = asyncio.run(_drive(run.url, slow_headers, slow_bodies,
                                    max(header_timeout_s, body_timeout_s) + CLOSE_MARGIN_S))
        result["gateway_cpu_s"] = round((process_cpu_s(run.pids["gateway"]) or 0.0)
                                        - cpu_before, 2)
    return {"slow_headers": slow_headers, "slow_bodies": slow_bodies,
            "header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s, **result}


async def _drive(url: str, slow_headers: int, slow_bodies: int,
                 wait_s: float) -> dict[str, Any]:
    import httpx

    host, port = url.removeprefix("http://").split(":")
    opened = time.perf_counter()
    slow = []
    for sent in [HEADERS_NEVER_ENDING] * slow_headers + [BODY_NEVER_ENDING] * slow_bodies:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(sent)
        slow.append((reader, writer))
    async with httpx.AsyncClient(timeout=60) as http:
        # Every slow client is in: its socket counted open, each slow body being read.
        deadline = time.monotonic() + 60
        while True:
            metrics = _samples((await http.get(url + "/metrics")).text)
            if (metrics.get("conveyor_gateway_connections_open", 0) >= slow_headers + slow_bodies
                    and metrics.get("conveyor_gateway_bodies_reading", 0) >= slow_bodies):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the slow clients did not all connect: {metrics}")
            await asyncio.sleep(0.1)
        held = time.perf_counter() - opened
        asked = time.perf_counter()
        normal = await http.post(url + "/v1/completions", json={
            "model": "m", "prompt": [5, 6, 7], "max_tokens": 16})
        answered_s = time.perf_counter() - asked
        closed = await asyncio.gather(*(_until_closed(r, wait_s) for r, _ in slow))
        last_closed_s = time.perf_counter() - opened
        metrics = _samples((await http.get(url + "/metrics")).text)
    for _, writer in slow:
        writer.close()
    headers, bodies = closed[:slow_headers], closed[slow_headers:]
    return {"slow_connected_in_s": round(held, 2),
            "normal_status": normal.status_code, "normal_answered_in_s": round(answered_s, 3),
            "slow_headers_closed_without_answer": sum(c == b"" for c in headers),
            "slow_bodies_closed_with_408": sum(c.startswith(b"HTTP/1.1 408")
                                               and b"body_timeout" in c for c in bodies),
            "not_closed": sum(c is None for c in closed),
            "last_closed_after_s": round(last_closed_s, 1),
            "gateway_timeouts": {kind: metrics.get(
                f'conveyor_gateway_timeouts_total{{kind="{kind}"}}', 0)
                for kind in ("header", "body")}}


async def _until_closed(reader: asyncio.StreamReader, wait_s: float) -> bytes | None:
    """Everything the gateway sent until it closed the connection; None when it was still
    open after ``wait_s``."""
    try:
        return await asyncio.wait_for(reader.read(), wait_s)
    except TimeoutError:
        return None
    except ConnectionError:
        return b""


def _samples(text: str) -> dict[str, float]:
    """Prometheus text: each sample's name (with its labels) and value."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.bench.gateway.slow_clients",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder (default: the small preset)")
    p.add_argument("--slow-headers", type=int, default=600,
                   help="connections that never finish their headers")
    p.add_argument("--slow-bodies", type=int, default=600,
                   help="connections that send one byte of a 100,000-byte body")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="the gateway's --header-timeout (its default: 10)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="the gateway's --body-timeout (its default: 30)")
    p.add_argument("--out", default=None, help="folder for the processes' logs")
    args = p.parse_args(argv)
    from producer.gateway.server import raise_open_files_limit
    from producer.logging import configure_logging
    from worker.modelgen.ensure import ensure_model

    configure_logging("warning")
    raise_open_files_limit(args.slow_headers + args.slow_bodies + 64)  # a socket each
    out = Path(args.out or tempfile.mkdtemp(prefix="gateway-slow-clients-"))
    out.mkdir(parents=True, exist_ok=True)
    result = measure(ensure_model(args.model, "small"), args.slow_headers, args.slow_bodies,
                     args.header_timeout, args.body_timeout, out)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
