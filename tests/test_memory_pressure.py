"""Preemption by swap and recompute, and the prefix cache, on the real engine."""

from __future__ import annotations

import random

import pytest
import torch

from kvstore import BlockPool, KVCacheManager, blocks_for
from kvstore.kv_tensors import PagedKVCache, copy_blocks
from worker import Engine, SamplingParams

BLOCK = 16


def pressure_workload(n: int = 64, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """64 requests, half greedy and half seeded, that together need ~4x the small pool."""
    rng = random.Random(seed)
    work = []
    for i in range(n):
        prompt = [rng.randrange(2, 1000) for _ in range(rng.randint(8, 120))]
        temperature = 0.0 if i % 2 == 0 else 0.8
        work.append((prompt, SamplingParams(max_tokens=rng.randint(16, 60), temperature=temperature,
                                            seed=i, ignore_eos=True)))
    return work


def blocks_needed(work) -> int:
    return sum(blocks_for(len(p) + sp.max_tokens, BLOCK) for p, sp in work)


def run(engine: Engine, work) -> list[list[int]]:
    completions = engine.generate([p for p, _ in work], [sp for _, sp in work])
    return [c.token_ids for c in completions]


@pytest.fixture(scope="module")
def unconstrained(tiny_llama):
    work = pressure_workload()
    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=blocks_needed(work) + 16,
                    max_num_seqs=64, max_num_batched_tokens=512)
    out = run(engine, work)
    assert engine.stats()["preemptions"] == 0
    return work, out


@pytest.mark.parametrize(
    ("mode", "swap_blocks", "expect"),
    [
        ("auto", 12, {"preemptions_swap", "preemptions_recompute"}),
        ("swap", 400, {"preemptions_swap"}),
        ("recompute", 0, {"preemptions_recompute"}),
    ],
)
def test_all_64_complete_under_pressure_with_identical_outputs(tiny_llama, unconstrained, mode,
                                                               swap_blocks, expect):
    work, expected = unconstrained
    pool = blocks_needed(work) // 4  # 25% of what all 64 need at once
    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=pool, swap_blocks=swap_blocks,
                    preemption_mode=mode, max_num_seqs=64, max_num_batched_tokens=512,
                    block_shuffle_seed=3)
    assert run(engine, work) == expected
    stats = engine.stats()
    for counter in expect:
        assert stats[counter] > 0, stats
    if mode == "swap":
        assert stats["swapped_in_blocks"] == stats["swapped_out_blocks"] > 0
    # Nothing is referenced any more: every block of both pools is free (cached ones count).
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    if engine.host_pool is not None:
        assert engine.host_pool.num_free == engine.host_pool.num_blocks
    engine.block_pool.check_invariants()


def test_swap_out_and_in_is_bit_identical_on_other_blocks():
    layers, num_blocks, heads, dim = 3, 12, 2, 8
    device = PagedKVCache(layers, num_blocks, BLOCK, heads, dim, torch.float64)
    host = PagedKVCache(layers, 8, BLOCK, heads, dim, torch.float64)
    pool, host_pool = BlockPool(num_blocks), BlockPool(8)
    kv = KVCacheManager(pool, BLOCK, host_pool=host_pool)
    kv.allocate("a", 3 * BLOCK)
    before = kv.block_table("a")
    gen = torch.Generator().manual_seed(0)
    for t in (*device.k, *device.v):
        t[before] = torch.randn(len(before), BLOCK, heads, dim, generator=gen, dtype=torch.float64)
    saved = [t[before].clone() for t in (*device.k, *device.v)]

    copy_blocks(device, host, kv.swap_out("a"))
    kv.allocate("b", 4 * BLOCK)  # someone else takes blocks meanwhile and overwrites them
    device.fill_blocks_(kv.block_table("b") + pool.free_block_ids(), float("nan"))
    copy_blocks(host, device, kv.swap_in("a"))

    after = kv.block_table("a")
    assert set(after).isdisjoint(before)
    for t, old in zip((*device.k, *device.v), saved, strict=True):
        assert torch.equal(t[after], old)
    kv.free("a"), kv.free("b")
    assert pool.num_free == num_blocks and host_pool.num_free == 8


def document_questions(vocab: int = 1000, seed: int = 0):
    rng = random.Random(seed)
    document = [rng.randrange(2, vocab) for _ in range(1900)]
    questions = [[rng.randrange(2, vocab) for _ in range(rng.randint(5, 15))] for _ in range(16)]
    return document, questions


def test_sixteen_questions_over_one_document_compute_it_once(tiny_llama):
    document, questions = document_questions()
    prompts = [document + q for q in questions]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def serve(caching: bool):
        engine = Engine(tiny_llama, dtype="float64", enable_prefix_caching=caching,
                        max_num_batched_tokens=8192, num_kv_blocks=2048, max_num_seqs=32)
        completions = engine.generate(prompts, params)
        decode_tokens = sum(len(c.token_ids) - 1 for c in completions)
        prefill = engine.runner.num_computed_tokens - decode_tokens
        return completions, prefill

    cached, cached_prefill = serve(True)
    uncached, uncached_prefill = serve(False)
    assert [c.token_ids for c in cached] == [c.token_ids for c in uncached]
    bound = len(document) + sum(len(q) for q in questions) + 16 * BLOCK
    assert cached_prefill <= bound < uncached_prefill
    hits = [c.usage.cached_tokens for c in cached]
    assert hits.count(0) == 1 and all(h >= len(document) - BLOCK for h in hits if h)
