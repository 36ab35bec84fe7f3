"""The CPU decode kernel (worker/host/csrc/paged_decode.cpp) against the torch path:
the same attention over the same paged cache, free blocks full of NaN, ragged lengths,
grouped query heads; and the engine's greedy tokens with the kernel on and off."""

from __future__ import annotations

import pytest
import torch
from kernel_fixtures import needs_kernel

from worker.attention.metadata import AttentionMetadata
from worker.attention.torch_backend import TorchAttention
from worker.host.cpu_kernels import paged_decode_kernel

kernel = paged_decode_kernel()


def _paged_case(dtype, seed=0, heads=8, kv_heads=2, dim=64, block_size=16, blocks=64):
    gen = torch.Generator().manual_seed(seed)
    lens = [1, 17, 16, 130, 5, 64]
    k_cache = torch.full((blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    order = torch.randperm(blocks, generator=gen).tolist()
    tables, taken = [], 0
    for n in lens:
        need = -(-n // block_size)
        tables.append(order[taken:taken + need])
        taken += need
    for table, n in zip(tables, lens, strict=True):  # only context slots get numbers
        for p in range(n):
            b, o = table[p // block_size], p % block_size
            k_cache[b, o] = torch.randn(kv_heads, dim, generator=gen, dtype=dtype)
            v_cache[b, o] = torch.randn(kv_heads, dim, generator=gen, dtype=dtype)
    q = torch.randn(len(lens), heads, dim, generator=gen, dtype=dtype)
    return q, k_cache, v_cache, tables, lens


# (query heads, kv heads, head_dim): float32 takes the vector path at head_dim 32, 64 and
# 128 (heads in runs of 16 / (head_dim / 16), across kv heads, then one by one), the plain
# path at any other head_dim or past 64 query heads.
SHAPES = [(8, 2, 64), (8, 8, 32), (12, 4, 128), (3, 3, 64), (7, 1, 32), (6, 2, 48), (80, 8, 16)]


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, dim", SHAPES, ids=str)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_the_kernel_attends_like_the_torch_path(dtype, tol, heads, kv_heads, dim, monkeypatch):
    q, k_cache, v_cache, tables, lens = _paged_case(dtype, heads=heads, kv_heads=kv_heads,
                                                    dim=dim)
    attn = TorchAttention(heads, kv_heads, dim, dim**-0.5)
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("CONVEYOR_CPU_KERNELS", switch)
        # The new token of each sequence is its last context position; write it again.
        meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size=16)
        flat_k = k_cache.view(-1, kv_heads, dim)
        k_new, v_new = flat_k[meta.slot_mapping].clone(), v_cache.view(-1, kv_heads, dim)[
            meta.slot_mapping].clone()
        results[switch] = attn.forward(q, k_new, v_new, k_cache, v_cache, meta)
        assert ("torch" in meta.backend_plans
                and (meta.backend_plans["torch"].kernel_decodes is not None) == (switch == "1"))
    assert not results["1"].isnan().any()
    torch.testing.assert_close(results["1"], results["0"], rtol=tol, atol=tol)


@needs_kernel
def test_the_kernel_refuses_a_length_outside_its_table():
    q, k_cache, v_cache, tables, lens = _paged_case(torch.float64)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lens_t = torch.tensor(lens)
    lens_t[0] = width * 16 + 1
    with pytest.raises(RuntimeError, match="outside its block table"):
        kernel(q, k_cache.view(-1, 2, 64), v_cache.view(-1, 2, 64), table, lens_t, 16, 0.125)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 8])
def test_sequences_handed_to_any_number_of_threads_attend_alike(threads):
    # csrc/each_task.h: sequences go to threads as they free up; with more threads than
    # sequences some find no work, with one the loop runs serially. Same results every way.
    q, k_cache, v_cache, tables, lens = _paged_case(torch.float32, seed=3)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    args = (k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim), padded,
            torch.tensor(lens), 16, dim**-0.5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        want = kernel(q, *args)
        torch.set_num_threads(threads)
        got = kernel(q, *args)
        few = kernel(q[:2], args[0], args[1], padded[:2], torch.tensor(lens[:2]), *args[4:])
    finally:
        torch.set_num_threads(before)
    assert not want.isnan().any()
    assert torch.equal(got, want) and torch.equal(few, want[:2])
