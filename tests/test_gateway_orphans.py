"""A gateway's streams never go silent (docs/gateway.md, "Waiting for a worker"): while a
stream waits it sends SSE comments, and once its model has had no live worker for the
orphan timeout the request is cancelled and the stream ends with `no_live_worker` (503
when not streamed). A worker that comes back before the timeout finishes the stream
exactly. The worker is a real `conveyor worker` process, killed with SIGKILL."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from fleet_fixtures import MODEL
from gateway_fixtures import serve_gateway
from waiting import eventually
from worker_processes import spawn_worker, stop_all, wait_ready

from producer.client.client import Client
from producer.wire.keys import Keys
from worker import Engine, SamplingParams
from worker.cli.gateway_verb import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    KEEPALIVE_S,
    KEEPALIVE_TIMEOUT_S,
    MAX_CONCURRENT,
    MAX_CONNECTIONS,
    ORPHAN_TIMEOUT_S,
    READ_CONNECTIONS,
    REDIS_CONNECTIONS,
    WATCH_TTL_S,
)

KEYS = Keys()
PROMPT = [5, 9, 23, 4, 77, 31, 8]
# Fast enough for a test: the heartbeat expires 3 beats after the worker dies.
WORKER_FLAGS = ("--heartbeat-interval", "0.3", "--lease-ms", "1000")
KEEPALIVE = 0.5


class Stream:
    """A streamed completion read on a thread: each line with the time it arrived."""

    def __init__(self, api: str, max_tokens: int) -> None:
        self.lines: list[tuple[float, str]] = []
        self.request_id = ""
        self.done = threading.Event()
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True}
        self._thread = threading.Thread(target=self._read, args=(api, body), daemon=True)
        self._thread.start()

    def _read(self, api: str, body: dict) -> None:
        try:
            with httpx.stream("POST", api + "/completions", json=body, timeout=120) as r:
                self.request_id = r.headers.get("x-request-id", "")
                for line in r.iter_lines():
                    if line:
                        self.lines.append((time.monotonic(), line))
        finally:
            self.done.set()

    def events(self) -> list[dict]:
        return [json.loads(line[6:]) for _, line in self.lines
                if line.startswith("data: {")]

    def text(self) -> str:
        return "".join(e["choices"][0]["text"] for e in self.events() if "choices" in e)


def _reference_text(tiny_llama, max_tokens: int) -> str:
    from worker.engine.tokenizer import Tokenizer

    done = Engine(tiny_llama, dtype="float64", num_kv_blocks=128).generate(
        [PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
    return Tokenizer.from_dir(tiny_llama).decode(done.token_ids)


def test_the_cli_defaults_are_the_settings_defaults():
    from producer.gateway.settings import KEEPALIVE_S as SETTINGS_KEEPALIVE
    from producer.gateway.settings import ORPHAN_TIMEOUT_S as SETTINGS_ORPHAN
    from producer.gateway.settings import GatewaySettings

    assert (KEEPALIVE_S, ORPHAN_TIMEOUT_S) == (SETTINGS_KEEPALIVE, SETTINGS_ORPHAN)
    assert WATCH_TTL_S == GatewaySettings().watch_ttl_s
    s = GatewaySettings()
    assert (MAX_CONCURRENT, REDIS_CONNECTIONS, READ_CONNECTIONS, MAX_CONNECTIONS) == (
        s.max_concurrent, s.redis_connections, s.read_connections, s.max_connections)
    assert (HEADER_TIMEOUT_S, BODY_TIMEOUT_S, KEEPALIVE_TIMEOUT_S) == (
        s.header_timeout_s, s.body_timeout_s, s.keepalive_timeout_s)
    assert SETTINGS_KEEPALIVE <= 15  # a waiting stream speaks at least every 15 s


@contextmanager
def only_worker(redis_url, tiny_llama, tmp_path) -> Iterator[tuple[subprocess.Popen, Client]]:
    """The model's one worker, serving, and a client; both stopped after."""
    worker = spawn_worker(tiny_llama, redis_url, "only", *WORKER_FLAGS, log_dir=tmp_path)
    client = Client(redis_url)
    try:
        wait_ready(client, "only", worker)
        yield worker, client
    finally:
        stop_all([worker])
        client.close()


def test_a_stream_whose_only_worker_dies_keeps_speaking_then_ends_no_live_worker(
        redis_url, tiny_llama, tmp_path):
    with only_worker(redis_url, tiny_llama, tmp_path) as (worker, client):
        with serve_gateway(redis_url, keepalive_s=KEEPALIVE, orphan_timeout_s=3) as gw:
            stream = Stream(gw.api, max_tokens=20_000)
            eventually(lambda: len(stream.text()) > 0, "the stream's first tokens")
            worker.send_signal(signal.SIGKILL)
            worker.wait(10)
            killed_at = time.monotonic()
            assert stream.done.wait(60), "the stream never ended"
        last = stream.events()[-1]
        assert last["error"]["code"] == "no_live_worker", last
        assert stream.lines[-1][1] == "data: [DONE]"
        # It kept speaking while it waited: comments, never a gap past the keep-alive.
        after = [t for t, _ in stream.lines if t > killed_at]
        comments = [t for t, line in stream.lines if line.startswith(":") and t > killed_at]
        assert len(comments) >= 2
        gaps = [b - a for a, b in zip([killed_at, *after], after, strict=False)]
        assert max(gaps) < 15
        # And the request was cancelled: a worker that takes it later drops it.
        assert client.redis.exists(KEYS.cancelled(stream.request_id))


def test_a_worker_that_comes_back_before_the_orphan_timeout_finishes_the_stream_exactly(
        redis_url, tiny_llama, tmp_path):
    max_tokens = 1500  # long: the first worker is still answering when it is killed
    want = _reference_text(tiny_llama, max_tokens)
    first = spawn_worker(tiny_llama, redis_url, "first", *WORKER_FLAGS, log_dir=tmp_path)
    client = Client(redis_url)
    procs = [first]
    try:
        wait_ready(client, "first", first)
        with serve_gateway(redis_url, keepalive_s=KEEPALIVE, orphan_timeout_s=60) as gw:
            stream = Stream(gw.api, max_tokens=max_tokens)
            eventually(lambda: len(stream.text()) > 0, "the stream's first tokens")
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            assert not stream.done.is_set()  # the precondition: it waits mid-answer
            eventually(lambda: any(line.startswith(":") for _, line in stream.lines),
                       "a keep-alive comment while no worker runs")
            second = spawn_worker(tiny_llama, redis_url, "second", *WORKER_FLAGS,
                                  log_dir=tmp_path)
            procs.append(second)
            assert stream.done.wait(120), "the stream never ended"
        events = stream.events()
        assert "error" not in events[-1], events[-1]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert stream.text() == want
    finally:
        stop_all(procs)
        client.close()


def test_an_answer_not_streamed_is_503_no_live_worker_and_cancelled(
        redis_url, tiny_llama, tmp_path):
    with only_worker(redis_url, tiny_llama, tmp_path) as (worker, client):
        with serve_gateway(redis_url, orphan_timeout_s=2) as gw:
            answer: dict = {}

            def ask() -> None:
                answer["response"] = httpx.post(
                    gw.api + "/completions", timeout=120,
                    json={"model": MODEL, "prompt": PROMPT, "max_tokens": 20_000,
                          "temperature": 0, "ignore_eos": True})

            asking = threading.Thread(target=ask, daemon=True)
            asking.start()
            lane = KEYS.requests(MODEL, "interactive")
            eventually(lambda: client.redis.exists(lane)
                       and client.redis.xpending(lane, "workers")["pending"] == 1,
                       "the worker holding the request")
            worker.send_signal(signal.SIGKILL)
            worker.wait(10)
            asking.join(60)
        response = answer["response"]
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "no_live_worker" and "cancelled" in error["message"]
        rid = response.headers["x-request-id"]
        assert client.redis.exists(KEYS.cancelled(rid))
