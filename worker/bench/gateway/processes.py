"""What a gateway benchmark runs against: a private redis-server, one simulated worker and
one `conveyor gateway` process, each a process of its own, stopped on the way out."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# How long the gateway may take to answer /health once started.
START_TIMEOUT_S = 60.0


@dataclass
class Serving:
    """The running processes: the gateway's URL, Redis's URL and a client of it, and each
    process's pid (for its CPU seconds)."""

    url: str
    redis_url: str
    redis: Any
    pids: dict[str, int]


@contextmanager
def serving(model_dir: Path, out: Path, worker_flags: list[str],
            gateway_flags: list[str]) -> Iterator[Serving]:
    """Redis, a worker of model ``m`` (``conveyor worker`` with ``worker_flags``) and a
    gateway (``conveyor gateway`` with ``gateway_flags``) until the block ends; their logs
    in ``out``. RuntimeError when the gateway does not answer /health in START_TIMEOUT_S."""
    import redis

    from producer.client.models import decode_hash, is_live
    from producer.redis.ephemeral import start_ephemeral
    from worker.bench.run.worker_process import WorkerProcess

    with tempfile.TemporaryDirectory() as folder:
        server = start_ephemeral(Path(folder))
        r = redis.Redis.from_url(server.url)
        try:
            with WorkerProcess("gw", model_dir, "m", server.url, "conveyor", worker_flags,
                               out / "worker.log") as worker:
                worker.start(r)
                port = 18000 + os.getpid() % 1000
                gateway = subprocess.Popen(
                    [sys.executable, "-m", "worker.cli", "gateway", "--redis", server.url,
                     "--port", str(port), *gateway_flags],
                    stdout=open(out / "gateway.log", "wb"),  # noqa: SIM115
                    stderr=subprocess.STDOUT)
                try:
                    url = f"http://127.0.0.1:{port}"
                    _wait_healthy(url, gateway, out)
                    assert is_live(decode_hash(r.hgetall(worker.key)))
                    yield Serving(url, server.url, r, {"gateway": gateway.pid,
                                                       "worker": worker.proc.pid,
                                                       "redis": server.pid})
                finally:
                    gateway.terminate()
                    gateway.wait(30)
        finally:
            server.stop()


def _wait_healthy(url: str, gateway: subprocess.Popen, out: Path) -> None:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or gateway.poll() is not None:
            raise RuntimeError(f"the gateway did not start: {out / 'gateway.log'}")
        time.sleep(0.2)
