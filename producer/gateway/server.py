"""How the gateway's HTTP server guards its sockets: timeouts for headers and idle
connections, a bound on open connections, and enough file descriptors for them.

uvicorn closes an idle kept-alive connection (``timeout_keep_alive``), but a client that
sends half its headers keeps its socket as long as it likes, and uvicorn's
``limit_concurrency`` answers 503 past its bound but keeps every socket open.
``guarded_protocol`` gives uvicorn's HTTP protocol a header timer (from the connection's
start, and from the end of each answer on a kept-alive one, to the end of the next
request's headers: a connection still without them is closed) and closes a connection
opened past ``max_connections`` at once. The body has its own
timeout in the app (producer/gateway/app.py), which takes a request's concurrency slot only
once its body is read.

The protocol is uvicorn's httptools one where httptools is installed (the gateway extra
brings it), else its h11 one: h11 parses and frames in Python, and at a thousand streams
its framing of each SSE event took ~10 µs of the gateway's CPU that httptools' does not
(docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

import structlog
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from producer.gateway.metrics import GatewayMetrics

log = structlog.get_logger(__name__)

# File descriptors a gateway needs besides its clients' sockets (Redis, logs, the loop).
SPARE_FDS = 256


def http_protocol() -> type:
    """uvicorn's httptools protocol where httptools is installed, else its h11 one."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return H11Protocol
    return HttpToolsProtocol


def guarded_protocol(header_timeout_s: float, keepalive_timeout_s: float,
                     max_connections: int, metrics: GatewayMetrics | None = None,
                     base: type | None = None) -> type:
    """uvicorn's HTTP protocol (``base``, default http_protocol()), closing a connection
    whose request headers take longer than ``header_timeout_s`` (after an answer on a
    kept-alive one: the keep-alive timeout more), and one opened past ``max_connections``;
    ``metrics`` count open connections, those timeouts and refusals."""
    protocol: Any = base or http_protocol()

    class HeaderTimedProtocol(protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _timed_cycle: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if metrics is not None:
                metrics.connections.inc()
            if len(self.connections) > max_connections:  # (this one counted already)
                if metrics is not None:
                    metrics.refused.labels("max_connections").inc()
                transport.close()
                return
            self._start_header_timer(header_timeout_s)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # (both protocols make a request's cycle once its headers are parsed)
            if self.cycle is not None and self.cycle is not self._timed_cycle:
                self._timed_cycle = self.cycle  # the headers of a request are in
                self._stop_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # (h11 parses a pipelined request here)
            # No request in progress (a pipelined one has its cycle already: httptools
            # made it when its headers came, h11 just now): the next request, if one comes,
            # gets the keep-alive timeout to begin and the header timeout for its headers.
            if not self.transport.is_closing() and (self.cycle is None
                                                    or self.cycle.response_complete):
                self._start_header_timer(keepalive_timeout_s + header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_timer()
            if metrics is not None:
                metrics.connections.dec()
            super().connection_lost(exc)

        def _start_header_timer(self, seconds: float) -> None:
            self._stop_header_timer()
            self._header_timer = self.loop.call_later(seconds, self._headers_late)

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                if metrics is not None:
                    metrics.timeouts.labels("header").inc()
                self.transport.close()

    return HeaderTimedProtocol


def server_config(app: Any, host: str, port: int, protocol: type | None = None
                  ) -> uvicorn.Config:
    """The uvicorn settings of a gateway app (producer.gateway.create_app): its protocol
    (``protocol``, default http_protocol()) with a header timeout and at most
    ``max_connections`` open connections (one past them is closed at once), and the
    keep-alive timeout."""
    gateway = app.state.gateway
    settings = gateway.settings
    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
        http=guarded_protocol(settings.header_timeout_s, settings.keepalive_timeout_s,
                              settings.max_connections, gateway.metrics, protocol),
        timeout_keep_alive=max(1, round(settings.keepalive_timeout_s)))


def raise_open_files_limit(max_connections: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (each connection is a file
    descriptor); returns the soft limit now, logged, with a warning where
    ``max_connections`` and SPARE_FDS do not fit in it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit", soft=soft, hard=hard,
                        error=str(exc))
    log.info("open files limit", limit=soft)
    if soft != resource.RLIM_INFINITY and max_connections + SPARE_FDS > soft:
        log.warning("--max-connections does not fit in the open files limit: connections past "
                    "it fail to open", max_connections=max_connections, limit=soft,
                    spare=SPARE_FDS)
    return soft
