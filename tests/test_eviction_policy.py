"""A worker refuses a Redis that may evict its request streams, unless told to accept it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis


@pytest.fixture
def evicting_redis(redis_client: redis.Redis) -> Iterator[None]:
    redis_client.config_set("maxmemory-policy", "allkeys-lru")
    yield
    redis_client.config_set("maxmemory-policy", "noeviction")


def test_a_worker_refuses_a_redis_that_may_evict_unless_told_to_accept_it(
        redis_client, evicting_redis, start_worker):
    assert redis_client.info("memory")["maxmemory_policy"] == "allkeys-lru"
    refused = start_worker("careful", autostart=False)
    with pytest.raises(ValueError, match="maxmemory-policy is 'allkeys-lru'"):
        refused.start()
    assert not redis_client.exists("conveyor:worker:careful")
    accepted = start_worker("reckless", config={"allow_eviction": True})
    assert accepted.state == "serving"


def test_conveyor_worker_exits_2_naming_the_policy(redis_url, tiny_llama, evicting_redis):
    # Its own process: the CLI sets up logging for the process it runs in.
    done = subprocess.run([sys.executable, "-m", "worker.cli", "worker", "--model",
                           str(tiny_llama), "--redis", redis_url], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "maxmemory-policy" in done.stderr and "--allow-eviction" in done.stderr
