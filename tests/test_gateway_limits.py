"""The gateway protects itself (a real gateway app under uvicorn, a simulated worker, raw
sockets for the slow clients): past --max-concurrent 429 gateway_busy with Retry-After; the
slot taken only once the body is read; header and body timeouts close slow clients while
others are answered; the open-files limit raised at start."""

from __future__ import annotations

import resource
import socket
import threading

import httpx
import pytest
from fleet_fixtures import MODEL
from gateway_fixtures import serve_gateway
from structlog.testing import capture_logs
from uvicorn.protocols.http.h11_impl import H11Protocol
from waiting import eventually

from producer.gateway.server import http_protocol, raise_open_files_limit

BODY = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4}


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=60)
    return s


def _slow_header(url: str) -> socket.socket:
    s = _connect(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n")  # and no more
    return s


def _slow_body(url: str) -> socket.socket:
    s = _connect(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json"
              b"\r\nContent-Length: 100000\r\n\r\n{")  # one byte of a body of 100,000
    return s


def _read_answer(s: socket.socket) -> bytes:
    """One whole answer with a Content-Length (its head and body may come apart)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def _metric(gateway, name: str, **labels: str) -> float:
    value = gateway.app.state.gateway.metrics.registry.get_sample_value(name, labels or None)
    return value or 0.0


def test_past_max_concurrent_a_request_gets_429_gateway_busy_with_retry_after(
        redis_url, start_worker):
    start_worker(simulate_step_ms=20, max_num_seqs=8)
    with serve_gateway(redis_url, max_concurrent=2) as gateway, \
            httpx.Client(timeout=60) as http:
        holding = []
        for i in range(2):  # two streams that take ~1 s each hold both slots
            resp = http.send(http.build_request("POST", f"{gateway.api}/completions", json={
                **BODY, "max_tokens": 50, "stream": True, "seed": i}), stream=True)
            holding.append(resp)
        eventually(lambda: gateway.app.state.gateway.active == 2, "both slots taken")
        busy = http.post(f"{gateway.api}/completions", json=BODY)
        tokenize = {"model": BODY["model"], "prompt": "The river"}
        busy_tokenizing = http.post(f"{gateway.url}/tokenize", json=tokenize)
        health = http.get(f"{gateway.url}/health")  # busy is not unhealthy
        for resp in holding:
            assert resp.status_code == 200 and list(resp.iter_lines())[-2] == "data: [DONE]"
            resp.close()
        eventually(lambda: gateway.app.state.gateway.active == 0, "the slots given back")
        after = http.post(f"{gateway.api}/completions", json=BODY)
        tokenized = http.post(f"{gateway.url}/tokenize", json=tokenize)
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    # Tokenizing takes a slot too (its work is the gateway's own).
    assert busy_tokenizing.status_code == 429 and tokenized.status_code == 200
    assert gateway.app.state.gateway.active == 0
    assert health.status_code == 200 and health.json() == {"status": "ok", "in_flight": 2,
                                                           "busy": True}
    assert busy.json()["error"]["code"] == "gateway_busy"
    assert _metric(gateway, "conveyor_gateway_refused_total", reason="gateway_busy") == 2
    assert after.status_code == 200


def test_slow_clients_are_cut_by_the_timeouts_and_hold_no_slot_meanwhile(
        redis_url, start_worker):
    start_worker(simulate_step_ms=1)
    with serve_gateway(redis_url, max_concurrent=1, header_timeout_s=3.0,
                       body_timeout_s=3.0) as gateway:
        slow = [_slow_header(gateway.url) for _ in range(40)]
        slow += [_slow_body(gateway.url) for _ in range(40)]
        # Precondition: every slow client is connected, and the 40 slow bodies are being
        # read by the app (the old gateway took each one's slot there: the one slot).
        eventually(lambda: _metric(gateway, "conveyor_gateway_connections_open") >= 80,
                   "the slow clients connected")
        eventually(lambda: _metric(gateway, "conveyor_gateway_bodies_reading") == 40,
                   "the slow bodies being read")
        with httpx.Client(timeout=60) as http:
            normal = http.post(f"{gateway.api}/completions", json=BODY)
        assert normal.status_code == 200  # answered while the 80 slow ones are open
        answers = [b""] * len(slow)

        def read_all(i: int) -> None:  # until the gateway closes the connection
            chunks = []
            while piece := slow[i].recv(65536):
                chunks.append(piece)
            answers[i] = b"".join(chunks)

        readers = [threading.Thread(target=read_all, args=(i,)) for i in range(len(slow))]
        for t in readers:
            t.start()
        for t in readers:
            t.join(timeout=60)
        for s in slow:
            s.close()
    assert not any(t.is_alive() for t in readers)  # every slow connection was closed
    assert all(a == b"" for a in answers[:40])  # headers never complete: closed, no answer
    assert all(a.startswith(b"HTTP/1.1 408") and b"body_timeout" in a for a in answers[40:])
    assert _metric(gateway, "conveyor_gateway_timeouts_total", kind="header") == 40
    assert _metric(gateway, "conveyor_gateway_timeouts_total", kind="body") == 40


PROTOCOLS = [pytest.param(http_protocol(), id="default"),
             pytest.param(H11Protocol, id="h11")]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_headers_that_never_end_are_cut_and_a_kept_alive_connection_gets_its_time(
        redis_url, protocol):
    """Either protocol the gateway may run: the header timer from the connection's start,
    and after an answer the keep-alive timeout more."""
    with serve_gateway(redis_url, protocol=protocol, header_timeout_s=0.5,
                       keepalive_timeout_s=1.0) as gateway:
        slow = _slow_header(gateway.url)
        kept = _connect(gateway.url)
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
        answer = _read_answer(kept)
        assert answer.startswith(b"HTTP/1.1 200")  # precondition: an answer on a kept one
        assert slow.recv(100) == b""  # closed by the header timeout, no answer
        closed_slow = _metric(gateway, "conveyor_gateway_timeouts_total", kind="header")
        assert kept.recv(100) == b""  # then the kept one: keep-alive (+ header) timeout
        for s in (slow, kept):
            s.close()
    assert closed_slow >= 1
    assert _metric(gateway, "conveyor_gateway_connections_open") == 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_pipelined_request_is_answered_whole_however_long_it_takes(redis_url, start_worker,
                                                                     protocol):
    """A request pipelined behind another is in progress when the first answer ends: no
    header timer runs on it (httptools made its cycle when its headers came)."""
    start_worker(simulate_step_ms=20, max_num_seqs=8)
    with serve_gateway(redis_url, protocol=protocol, header_timeout_s=0.3,
                       keepalive_timeout_s=0.3) as gateway:
        body = (b'{"model": "%s", "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": true, '
                b'"stream": true}' % MODEL.encode())
        s = _connect(gateway.url)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n"
                  b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b"[DONE]" not in got and (piece := s.recv(65536)):
            got += piece
        s.close()
    assert got.count(b"HTTP/1.1 200") == 2  # both answered
    assert b"[DONE]" in got  # the stream (40 steps of 20 ms, past both timers) whole


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_connection_past_max_connections_is_closed_at_once(redis_url, protocol):
    with serve_gateway(redis_url, protocol=protocol, max_connections=3) as gateway:
        held = [_connect(gateway.url) for _ in range(3)]
        eventually(lambda: _metric(gateway, "conveyor_gateway_connections_open") == 3,
                   "three connections open")
        extra = _connect(gateway.url)
        assert extra.recv(100) == b""  # closed without an answer
        for s in (*held, extra):
            s.close()
    assert _metric(gateway, "conveyor_gateway_refused_total", reason="max_connections") == 1


def test_the_open_files_limit_is_raised_to_the_hard_one_and_a_misfit_is_said():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if hard != resource.RLIM_INFINITY and hard > 64:
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))  # precondition: below it
        with capture_logs() as logs:
            now = raise_open_files_limit(max_connections=10**9)
        assert now == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if hard != resource.RLIM_INFINITY:
            assert now == hard
        assert any(e["event"] == "open files limit" for e in logs)
        assert any("does not fit" in e["event"] and e["log_level"] == "warning" for e in logs)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_gateways_counters_start_at_zero_for_every_known_label():
    """A series born at its first event shows no increase for it: rate() and increase()
    miss the first timeout, refusal or 500 (and a panel reads "No data"). Every known label
    starts at 0; no `*_created` series double what is scraped."""
    from producer.gateway.metrics import GatewayMetrics

    text = GatewayMetrics().exposition()[0].decode()
    for series in ['conveyor_gateway_timeouts_total{kind="header"} 0.0',
                   'conveyor_gateway_timeouts_total{kind="body"} 0.0',
                   'conveyor_gateway_refused_total{reason="gateway_busy"} 0.0',
                   'conveyor_gateway_refused_total{reason="max_connections"} 0.0',
                   'conveyor_gateway_requests_total{endpoint="/v1/chat/completions",'
                   'status="500"} 0.0',
                   'conveyor_gateway_response_seconds_count{endpoint="/v1/completions"} 0.0']:
        assert series in text.splitlines(), series
    assert "_created" not in text
