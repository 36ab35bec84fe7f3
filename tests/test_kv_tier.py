"""The fleet KV tier on a real Redis: whole blocks out of one paged cache and into another,
exactly; every way a transfer can be unusable is caught and named; the tier never takes
more room than it is given."""

from __future__ import annotations

import pytest
import redis
import torch

from kvstore.kv_tensors import PagedKVCache, block_layout, export_blocks, import_blocks
from kvstore.tier import TierCorrupt, TierMismatch, TierMiss, TierRefused
from kvstore.tier.redis_tier import RedisKVTier

FINGERPRINT = "model-a"


def _cache(dtype=torch.float32, block_size=4, blocks=8, seed=0) -> PagedKVCache:
    cache = PagedKVCache(num_layers=3, num_blocks=blocks, block_size=block_size,
                         num_kv_heads=2, head_dim=8, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    for t in (*cache.k, *cache.v):
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float64).to(dtype))
    return cache


def _store(tier: RedisKVTier, cache: PagedKVCache, blocks: list[int], name: str = "r1"):
    layout = block_layout(cache, FINGERPRINT)
    return tier.put(name, layout, export_blocks(cache, blocks), len(blocks),
                    num_tokens=len(blocks) * cache.block_size - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_blocks_cross_the_tier_into_other_slots_bit_for_bit(redis_client, dtype):
    tier = RedisKVTier(redis_client, chunk_bytes=1000)  # several chunks per run
    source, target = _cache(dtype), _cache(dtype, seed=1)
    header = _store(tier, source, [3, 1, 7])
    assert len(header.chunk_sizes) > 1 and max(header.chunk_sizes) <= 1000
    got, payload = tier.get("r1", block_layout(target, FINGERPRINT))
    assert got == header and got.num_tokens == 11
    import_blocks(target, [0, 2, 5], payload)
    for s, t in zip((*source.k, *source.v), (*target.k, *target.v), strict=True):
        assert torch.equal(t[[0, 2, 5]], s[[3, 1, 7]])
    # Every key has a TTL: nothing in the tier outlives it.
    runs = redis_client.keys("conveyor:kv:{*")
    assert runs and all(0 < redis_client.pttl(k) <= 600_000 for k in runs)
    counts = redis_client.keys("conveyor:kv:bytes:*")  # a bucket outlives its runs a little
    assert counts and all(0 < redis_client.pttl(k) <= 900_000 for k in counts)


def test_a_missing_transfer_is_a_miss(redis_client):
    tier = RedisKVTier(redis_client)
    with pytest.raises(TierMiss):
        tier.get("never", block_layout(_cache(), FINGERPRINT))
    _store(tier, _cache(), [0, 1])
    for key in redis_client.keys("conveyor:kv:*"):  # what an expiry or an operator does
        redis_client.delete(key)
    with pytest.raises(TierMiss):
        tier.get("r1", block_layout(_cache(), FINGERPRINT))


def test_a_truncated_transfer_is_corrupt(redis_client):
    tier = RedisKVTier(redis_client, chunk_bytes=1000)
    _store(tier, _cache(), [0, 1, 2])
    chunk = tier.chunk_key("r1", 1)
    redis_client.set(chunk, redis_client.get(chunk)[:-1])
    with pytest.raises(TierCorrupt, match="chunk 1"):
        tier.get("r1", block_layout(_cache(), FINGERPRINT))
    redis_client.delete(chunk)
    with pytest.raises(TierCorrupt, match="missing or truncated"):
        tier.get("r1", block_layout(_cache(), FINGERPRINT))


def test_a_flipped_byte_fails_the_checksum(redis_client):
    tier = RedisKVTier(redis_client)
    _store(tier, _cache(), [0, 1])
    chunk = tier.chunk_key("r1", 0)
    data = bytearray(redis_client.get(chunk))
    data[17] ^= 0x01
    redis_client.set(chunk, bytes(data))
    with pytest.raises(TierCorrupt, match="checksum"):
        tier.get("r1", block_layout(_cache(), FINGERPRINT))


def test_an_unreadable_header_is_corrupt(redis_client):
    tier = RedisKVTier(redis_client)
    redis_client.set(tier.header_key("r1"), b"\x93not a header")
    with pytest.raises(TierCorrupt, match="header"):
        tier.get("r1", block_layout(_cache(), FINGERPRINT))


@pytest.mark.parametrize("reader, field", [
    (lambda: block_layout(_cache(), "model-b"), "fingerprint"),
    (lambda: block_layout(_cache(torch.float64), FINGERPRINT), "dtype"),
    (lambda: block_layout(_cache(block_size=8), FINGERPRINT), "block_size"),
], ids=["other-model", "other-dtype", "other-block-size"])
def test_kv_of_another_model_dtype_or_block_size_is_refused(redis_client, reader, field):
    tier = RedisKVTier(redis_client)
    _store(tier, _cache(), [0, 1])
    with pytest.raises(TierMismatch, match=field):
        tier.get("r1", reader())


def test_the_tier_refuses_past_its_size_bound_and_has_room_again_after_a_delete(redis_client):
    cache = _cache()
    size = block_layout(cache, FINGERPRINT).bytes_per_block * 2
    tier = RedisKVTier(redis_client, max_bytes=size + 10)
    _store(tier, cache, [0, 1], "a")
    assert tier.bytes_in_use() == size
    with pytest.raises(TierRefused, match="no room"):
        _store(tier, cache, [2, 3], "b")
    assert not tier.has("b") and not redis_client.keys("conveyor:kv:{b}*")  # nothing written
    tier.delete("a")
    assert tier.bytes_in_use() == 0 and not redis_client.keys("conveyor:kv:{a}*")
    _store(tier, cache, [2, 3], "b")
    assert tier.has("b")


def test_the_tier_stays_below_redis_maxmemory(redis_client):
    used = int(redis_client.info("memory")["used_memory"])
    tier = RedisKVTier(redis_client, maxmemory_fraction=0.5)
    redis_client.config_set("maxmemory", str(used + 4096))  # the queues' headroom only
    try:
        with pytest.raises(TierRefused, match="maxmemory"):
            _store(tier, _cache(), [0, 1])
        assert not tier.has("r1")
    finally:
        redis_client.config_set("maxmemory", "0")


class _FilledSinceItsCheck(RedisKVTier):
    """Redis filled up between the tier's room check and its writes (other writers)."""

    def _check_room(self, nbytes: int) -> None:
        pass


def test_a_write_redis_refuses_is_refused_not_raised_raw(redis_client):
    tier = _FilledSinceItsCheck(redis_client)
    used = int(redis_client.info("memory")["used_memory"])
    # Already past the limit, as after other writers filled it: Redis refuses the first
    # write (a limit just above the use let a small write through when the use fell).
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", str(used // 2))
    try:
        refused_before = _refused_writes(redis_client)
        with pytest.raises(TierRefused, match="refused"):
            _store(tier, _cache(), [0, 1])
        assert _refused_writes(redis_client) > refused_before  # Redis really said OOM
        assert not tier.has("r1")
    finally:
        redis_client.config_set("maxmemory", "0")


def _refused_writes(client: redis.Redis) -> int:
    stats = client.info("errorstats")
    return int(stats.get("errorstat_OOM", {}).get("count", 0))


def test_the_byte_count_forgets_runs_once_they_have_expired_and_never_counts_twice(
        redis_client):
    clock = [1000.0]
    tier = RedisKVTier(redis_client, ttl_s=100, now=lambda: clock[0])
    cache = _cache()
    size = block_layout(cache, FINGERPRINT).bytes_per_block * 2
    _store(tier, cache, [0, 1], "a")
    _store(tier, cache, [0, 1], "a")  # an overwrite takes the old run's bytes back first
    assert tier.bytes_in_use() == size
    clock[0] += 100 + 25  # past the run's TTL and the bucket it was counted in
    assert tier.bytes_in_use() == 0
    _store(tier, cache, [2, 3], "b")
    tier.delete("b")
    assert tier.bytes_in_use() == 0
