"""Redis fixtures: one real, private redis-server per test session, flushed before each test.

Import them in conftest.py: ``from redis_fixtures import redis_client, redis_server, redis_url``.
The server lives in a pytest temp folder and never touches the user's data folder.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from producer.connection import connect
from producer.redis_server import EphemeralRedis, start_ephemeral


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EphemeralRedis]:
    """A redis-server for the whole session (append-only file on, so ``restart()`` keeps data)."""
    server = start_ephemeral(tmp_path_factory.mktemp("redis"), appendonly="yes")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: EphemeralRedis) -> str:
    """The session server's URL, with an empty keyspace for this test."""
    if redis_server.pid is None:
        redis_server.start()  # an earlier test stopped it to inject a fault
    with connect(redis_server.url) as client:
        client.flushall()
    return redis_server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the flushed session server (bytes replies, like the project's own clients)."""
    client = connect(redis_url)
    try:
        yield client
    finally:
        client.close()
