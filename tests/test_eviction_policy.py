"""A worker refuses a Redis that may evict its request streams, unless told to accept it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from worker.cli import main


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


def test_conveyor_worker_exits_2_naming_the_policy(redis_url, tiny_llama, evicting_redis,
                                                  capfd):
    assert main(["worker", "--model", str(tiny_llama), "--redis", redis_url]) == 2
    err = capfd.readouterr().err
    assert "maxmemory-policy" in err and "--allow-eviction" in err
