"""A `conveyor worker` child process for a benchmark run: start, wait until serving, stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from producer.client.models import decode_hash, is_live
from producer.wire.keys import Keys

# The bench reads KV use from heartbeats: beat more often than a serving worker does.
HEARTBEAT_INTERVAL_S = 0.2
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


class WorkerProcess:
    """``with WorkerProcess(...) as w:`` a worker serving ``model_name`` until the block ends."""

    def __init__(self, label: str, model_dir: Path, model_name: str, redis_url: str,
                 namespace: str, worker_flags: list[str], log_path: Path) -> None:
        self.worker_id = f"bench-{os.getpid()}-{label}"
        self.key = Keys(namespace).worker(self.worker_id)
        self.log_path = log_path
        # Debug logs: a line a request admitted, with its queue wait (read by queue_waits).
        # Its /metrics on a free local port (its heartbeat says which): histograms of what
        # only the worker times (histogram_buckets).
        self.cmd = [sys.executable, "-m", "worker.cli", "--log-level", "debug", "worker",
                    "--model", str(model_dir),
                    "--served-model-name", model_name, "--redis", redis_url,
                    "--namespace", namespace, "--name", self.worker_id,
                    "--heartbeat-interval", str(HEARTBEAT_INTERVAL_S),
                    "--metrics-port", "0", "--metrics-host", "127.0.0.1", *worker_flags]
        self.metrics_port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, client: redis.Redis) -> None:
        """Spawn the worker and wait until its heartbeat says it serves (it registered the
        model before; a heartbeat that says "starting" comes earlier)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not is_live(beat := decode_hash(client.hgetall(self.key))):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the bench worker did not start in {START_TIMEOUT_S:.0f} s"
                                   f"{self.log_tail()}")
            time.sleep(0.1)
        self.metrics_port = int(beat["metrics_port"]) if beat.get("metrics_port") else None

    def histogram_buckets(self, name: str) -> dict[float, float] | None:
        """Histogram ``name``'s cumulative counts by upper bound, from the worker's /metrics
        now (summed over its label sets); None when it serves none or does not answer."""
        if self.metrics_port is None:
            return None
        from urllib.request import urlopen

        from prometheus_client.parser import text_string_to_metric_families

        try:
            with urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
                text = reply.read().decode()
        except OSError:
            return None
        buckets: dict[float, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == f"{name}_bucket":
                    le = float(sample.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + sample.value
        return buckets or None

    def queue_waits(self) -> dict[str, float]:
        """Milliseconds each request this worker admitted waited in Redis (created to
        admitted), from its log."""
        waits = {}
        with open(self.log_path, "rb") as log:
            for line in log:
                if b'"request admitted"' not in line:
                    continue
                try:
                    event = json.loads(line)
                    waits[event["request_id"]] = float(event["queue_wait_ms"])
                except (ValueError, KeyError, TypeError):
                    continue
        return waits

    def check_alive(self) -> None:
        """RuntimeError with the worker's log tail when it has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the bench worker exited with status {self.proc.returncode}"
                               f"{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM (drain), then SIGKILL if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        text = self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""
        return f"; its log ({self.log_path}):\n{text}" if text else ""

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
