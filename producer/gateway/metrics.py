"""The gateway's Prometheus metrics (its own registry: several apps in one process, as in
the tests, do not collide)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from producer.wire.openai_api import CHAT_URL, COMPLETIONS_URL

# No `*_created` series beside every counter and histogram (the worker's neither).
disable_created_metrics()
# The series made at start, at zero: a counter's first event then shows in rate() and
# increase() (a series born at 1 has no increase to show), and a panel has data at once.
ENDPOINTS = (COMPLETIONS_URL, CHAT_URL)
STATUSES = ("200", "400", "401", "404", "408", "413", "429", "499", "500", "503")
REFUSALS = ("gateway_busy", "max_connections")
TIMEOUTS = ("header", "body")

# Seconds until the response starts (the whole answer when not streamed).
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Streams one shared XREAD names (producer/gateway/shared_reads.py).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("conveyor_gateway_requests_total",
                                "HTTP requests to the generation endpoints, by status",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("conveyor_gateway_response_seconds",
                                 "seconds until the response started (the whole answer "
                                 "when not streamed)", ["endpoint"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.streams_open = Gauge("conveyor_gateway_streams_open",
                                  "streamed answers being sent now", registry=self.registry)
        self.cancelled = Counter("conveyor_gateway_cancelled_total",
                                 "requests cancelled because their client went away",
                                 registry=self.registry)
        self.orphaned = Counter("conveyor_gateway_orphaned_total",
                                "requests cancelled because their model had no live worker "
                                "for the orphan timeout", registry=self.registry)
        self.refused = Counter("conveyor_gateway_refused_total",
                               "requests or connections refused, by reason (gateway_busy: "
                               "--max-concurrent reached; max_connections: a connection "
                               "closed at once)", ["reason"],
                               registry=self.registry)
        self.timeouts = Counter("conveyor_gateway_timeouts_total",
                                "client connections cut by a timeout, by kind (header, body)",
                                ["kind"], registry=self.registry)
        self.in_flight = Gauge("conveyor_gateway_requests_in_flight",
                               "generation requests being answered now (--max-concurrent "
                               "bounds them)", registry=self.registry)
        self.reading_bodies = Gauge("conveyor_gateway_bodies_reading",
                                    "requests whose body is being read (they hold no "
                                    "--max-concurrent slot yet)", registry=self.registry)
        self.connections = Gauge("conveyor_gateway_connections_open",
                                 "client connections open now (--max-connections bounds them)",
                                 registry=self.registry)
        self.shared_read = Histogram("conveyor_gateway_shared_read_streams",
                                     "streams each shared XREAD names (the answers of all "
                                     "requests are read through a few)", buckets=BATCH_BUCKETS,
                                     registry=self.registry)

        for endpoint in ENDPOINTS:
            self.latency.labels(endpoint)
            for status in STATUSES:
                self.requests.labels(endpoint, status)
        for reason in REFUSALS:
            self.refused.labels(reason)
        for kind in TIMEOUTS:
            self.timeouts.labels(kind)

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
