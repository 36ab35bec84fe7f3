"""Worker subprocesses for fault tests: real processes that can be killed and signalled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from producer.client.client import Client
from producer.client.models import decode_hash, is_live
from producer.wire.keys import Keys


def spawn_worker(model_dir: Path, redis_url: str, name: str, *extra: str,
                 env: dict[str, str] | None = None,
                 log_dir: Path | None = None, log_level: str = "warning") -> subprocess.Popen:
    """Start `conveyor worker` serving the tiny model as "tiny", float64, one thread; its JSON
    log lines go to ``log_dir/NAME.log``."""
    cmd = [sys.executable, "-m", "worker.cli", "--log-level", log_level, "worker",
           "--model", str(model_dir), "--served-model-name", "tiny", "--redis", redis_url,
           "--name", name, "--dtype", "float64", "--threads", "1", *extra]
    out = open(log_dir / f"{name}.log", "wb") if log_dir else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})


def wait_ready(client: Client, name: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Wait until the worker's heartbeat says it serves (one that says "starting" comes
    before it registers its model); fail if it exits first."""
    key = Keys().worker(name)
    deadline = time.monotonic() + timeout
    while not is_live(decode_hash(client.redis.hgetall(key))):
        assert proc.poll() is None, f"worker {name} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"worker {name} did not start"
        time.sleep(0.1)


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def log_events(log_dir: Path, name: str, event: str) -> list[dict]:
    """The JSON log lines of worker ``name`` whose event is ``event``."""
    found = []
    for line in (log_dir / f"{name}.log").read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            found.append(record)
    return found
