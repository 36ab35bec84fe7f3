"""Requests tied to their asker's life (docs/reliability.md, "Requests tied to their
asker's life"): a producer keeps a watch key alive and marks its requests with it; a
worker cancels a marked request once the key lapses. The gateway marks every request, so
a gateway that dies takes its requests with it instead of leaving them to run for nobody."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from fleet_fixtures import MODEL
from waiting import eventually
from worker_processes import spawn_worker, stop_all, wait_ready

from producer.client.client import Client
from producer.client.connection import connect
from producer.client.stream_events import ChunkEvent
from producer.client.watch import WATCH_RENEW_S, WATCH_TTL_S, WatchKeeper
from producer.wire.completion import FinishReason
from producer.wire.keys import Keys
from producer.wire.params import SamplingParams
from producer.wire.protocol import FIELD, GenerationRequest
from worker.fleet.housekeeping.leases import WATCH_GRACE_S

KEYS = Keys()
ROOT = Path(__file__).resolve().parents[1]


def test_the_keeper_sets_its_key_renews_it_and_lets_it_lapse_when_stopped(redis_client):
    assert WATCH_RENEW_S <= 10 < WATCH_TTL_S  # renewed at least every 10 s
    keeper = WatchKeeper(redis_client, KEYS, ttl_s=2, renew_s=0.2)
    keeper.start()
    assert 0 < redis_client.pttl(keeper.key) <= 2000
    eventually(lambda: redis_client.pttl(keeper.key) < 1900, "the TTL running down")
    eventually(lambda: redis_client.pttl(keeper.key) > 1950, "a renewal")
    keeper.stop()
    eventually(lambda: not redis_client.exists(keeper.key), "the key lapsing", patience_s=10)


def test_a_client_that_watches_marks_its_requests(redis_url, redis_client):
    with Client(redis_url, watch=True) as watching, Client(redis_url) as plain:
        marked = watching.submit("a", model=MODEL, max_tokens=1, allow_unregistered=True)
        unmarked = plain.submit("b", model=MODEL, max_tokens=1, allow_unregistered=True)
        requests = {r.request_id: r for r in (
            GenerationRequest.decode(f[FIELD])
            for _, f in redis_client.xrange(KEYS.requests(MODEL, "interactive")))}
        watch = requests[marked].watch
        assert watch is not None and requests[unmarked].watch is None
        assert 0 < redis_client.ttl(KEYS.watch(watch)) <= WATCH_TTL_S


def test_a_worker_cancels_a_running_request_whose_watch_lapsed(each_redis, start_worker):
    redis_client = connect(each_redis.url)
    redis_client.flushall()
    # Checked with each lease renewal: a third of the lease (0.2 s here).
    worker = start_worker(url=each_redis.url, config={"lease_ms": 600})
    watch = "f" * 32
    redis_client.set(KEYS.watch(watch), b"1", ex=60)
    request = GenerationRequest("r-watched", MODEL, SamplingParams(
        max_tokens=2000, temperature=0, ignore_eos=True), prompt_token_ids=[5, 6, 7],
        watch=watch)
    redis_client.xadd(KEYS.requests(MODEL, "interactive"), {FIELD: request.encode()})
    client = Client(connection=redis_client)
    eventually(lambda: client.last_event("r-watched") is not None, "the request running")
    worker.loop.pause()  # it would reach its length limit before the grace is over
    assert worker.leases.orphaned == 0  # the precondition: its watch is alive
    redis_client.delete(KEYS.watch(watch))  # the producer died: its watch lapsed
    eventually(lambda: worker.leases.watches_missing == 1, "the watch seen missing")
    eventually(lambda: worker.leases.orphaned == 1, "the grace over", patience_s=30)
    worker.loop.resume()
    done = client.result("r-watched", timeout=60)
    assert done.finish_reason == FinishReason.CANCELLED
    assert len(done.token_ids) < 2000 and worker.status()["watch_cancelled"] == 1
    redis_client.close()


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def test_a_request_whose_gateway_dies_mid_stream_is_cancelled_for_its_lapsed_watch(
        redis_url, tiny_llama, tmp_path):
    # A lease of 3 s: the worker looks at watches every second. The gateway's watch lives
    # 3 s after it (20 by default: the bound below holds for that too).
    worker = spawn_worker(tiny_llama, redis_url, "w", "--lease-ms", "3000",
                          "--heartbeat-interval", "0.2", log_dir=tmp_path)
    port = _free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "gateway", "--redis", redis_url, "--port",
         str(port), "--watch-ttl", "3"], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    client = Client(redis_url)
    try:
        wait_ready(client, "w", worker)
        api = f"http://127.0.0.1:{port}/v1"
        eventually(lambda: _answers(api), "the gateway listening", patience_s=60)
        got: dict = {"lines": 0}

        def read() -> None:
            body = {"model": MODEL, "prompt": [5, 9, 23], "max_tokens": 2000, "stream": True,
                    "temperature": 0, "ignore_eos": True}
            try:
                with httpx.stream("POST", api + "/completions", json=body, timeout=120) as r:
                    got["id"] = r.headers["x-request-id"]
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            got["lines"] += 1
                            json.loads(line[6:])
            except httpx.HTTPError:
                pass  # the gateway died under it

        threading.Thread(target=read, daemon=True).start()
        eventually(lambda: got["lines"] >= 2, "the answer streaming")
        gateway.send_signal(signal.SIGKILL)
        gateway.wait(10)
        # The tiny model would reach its length limit before any watch lapses: the worker
        # is held (SIGSTOP) until the gateway's watch is gone, runs until it has seen that,
        # and is held again for the grace a missing watch gets (real time passes for it).
        worker.send_signal(signal.SIGSTOP)
        # Its own watch: other tests' clients share this Redis and may hold theirs.
        watch = KEYS.watch(_watch_of(client, got["id"]))
        eventually(lambda: not client.redis.exists(watch), "the watch lapsing")
        assert isinstance(client.last_event(got["id"]), ChunkEvent)  # still running
        worker.send_signal(signal.SIGCONT)
        eventually(lambda: _heartbeat(client, "w").get("watches_missing") == "1",
                   "the worker seeing the watch missing")
        worker.send_signal(signal.SIGSTOP)
        time.sleep(WATCH_GRACE_S)
        worker.send_signal(signal.SIGCONT)
        done = client.result(got["id"], timeout=120)
        assert done.finish_reason == FinishReason.CANCELLED, done.finish_reason
        assert len(done.token_ids) < 2000  # not at its length limit
        # Cancelled for its lapsed watch, by the worker (no one else cancelled it). How soon
        # follows from the settings, not from this machine's speed: the watch's TTL, the
        # worker's 5 s grace and its looks every 2.5 s (20 + 5 + 2.5 s by default).
        eventually(lambda: _heartbeat(client, "w").get("watch_cancelled") == "1",
                   "the worker's heartbeat counting the cancel")
        assert not client.redis.exists(KEYS.cancelled(got["id"]))
    finally:
        gateway.kill()
        gateway.wait(10)
        stop_all([worker])
        client.close()


def _watch_of(client: Client, request_id: str) -> str:
    """The watch the gateway marked ``request_id`` with, read from the request lanes."""
    for lane in client.redis.keys(KEYS.requests_pattern):
        if client.redis.type(lane) != b"stream":
            continue
        for _, fields in client.redis.xrange(lane):
            if FIELD in fields:
                request = GenerationRequest.decode(fields[FIELD])
                if request.request_id == request_id:
                    assert request.watch is not None, "the gateway marks its requests"
                    return request.watch
    raise AssertionError(f"request {request_id} not on any lane")


def _heartbeat(client: Client, worker_id: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.redis.hgetall(KEYS.worker(worker_id)).items()}


def _answers(api: str) -> bool:
    try:
        return httpx.get(api + "/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
