"""A real `conveyor gateway` app served by uvicorn on a free local port, in a thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from waiting import eventually


@dataclass
class RunningGateway:
    url: str  # http://127.0.0.1:PORT
    app: object

    @property
    def api(self) -> str:
        return self.url + "/v1"


@contextmanager
def serve_gateway(redis_url: str, protocol: type | None = None, **settings
                  ) -> Iterator[RunningGateway]:
    import uvicorn

    from producer.gateway import GatewaySettings, create_app
    from producer.gateway.server import server_config

    app = create_app(GatewaySettings(redis_url=redis_url, **settings))
    # as `conveyor gateway` (``protocol``: uvicorn's HTTP protocol, default the gateway's)
    server = uvicorn.Server(server_config(app, "127.0.0.1", 0, protocol))
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    eventually(lambda: server.started or not thread.is_alive(), "the gateway listening")
    assert server.started, "the gateway did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningGateway(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def gateway(redis_url):
    """A gateway on the test Redis (no API key)."""
    with serve_gateway(redis_url) as running:
        yield running
