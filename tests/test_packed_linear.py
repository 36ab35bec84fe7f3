"""The packed matmul (csrc/packed_linear.h) and the packed copies it reads
(worker/models/packed_weights.py): the BLAS's results to float32 rounding for every row
block, a ragged last panel and tile, and past one chunk of rows, the same bits on any number
of threads and for a row alone or beside others, a copy made once and
made again when its weight is written, and none where packing is switched off."""

from __future__ import annotations

import pytest
import torch
from kernel_fixtures import needs_kernel

from producer.settings import CPU_MATMUL
from worker.host.cpu_kernels import cpu_kernels
from worker.models import packed_weights
from worker.models.linear import linear

ENV_SWITCH = CPU_MATMUL.name


def _case(rows: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen),
            torch.randn(n, generator=gen))


@needs_kernel
# Row blocks of 12, 8, 4 and 1-3 and their mixes; 70 outputs: two panels and a ragged third.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 11, 12, 13, 25, 64, 192])
@pytest.mark.parametrize("bias", [False, True])
def test_the_packed_matmul_equals_the_blas(rows, bias):
    x, w, b = _case(rows, 70, 37, seed=rows)
    module = cpu_kernels()
    packed = module.pack_weight(w)
    assert packed.shape == (3, 37, 32)
    got = module.packed_linear(x, packed, 70, b if bias else torch.empty(0))
    want = torch.nn.functional.linear(x.double(), w.double(), b.double() if bias else None)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


@needs_kernel
# K of 150 is two whole tiles of the panel and a ragged third (the kernel walks 64 k rows at a
# time, prefetching the next); 200 rows are a full chunk of 192 and a second one.
@pytest.mark.parametrize("rows", [1, 13, 64, 200])
def test_the_packed_matmul_sums_across_tiles_and_row_chunks(rows):
    x, w, b = _case(rows, 70, 150, seed=rows)
    module = cpu_kernels()
    got = module.packed_linear(x, module.pack_weight(w), 70, b)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_an_empty_inner_dimension_gives_the_bias():
    module = cpu_kernels()
    packed = module.pack_weight(torch.empty(40, 0))
    b = torch.randn(40)
    got = module.packed_linear(torch.empty(3, 0), packed, 40, b)
    assert torch.equal(got, b.expand(3, 40))


@needs_kernel
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    # Every output is one sum in k order, whatever block of rows (12, 8, 4, 1-3) or chunk
    # of 192 it falls in: a request's logits are the same alone and in any batch.
    x, w, b = _case(200, 70, 150, seed=3)
    module = cpu_kernels()
    packed = module.pack_weight(w)
    whole = module.packed_linear(x, packed, 70, b)
    for start, rows in [(0, 1), (5, 3), (17, 12), (100, 64), (190, 10)]:
        part = module.packed_linear(x[start:start + rows].contiguous(), packed, 70, b)
        assert torch.equal(part, whole[start:start + rows])


@needs_kernel
def test_the_packed_matmul_gives_the_same_bits_on_any_number_of_threads():
    # Each panel is one thread's whole sum, in one order, whichever thread takes it.
    x, w, b = _case(29, 200, 64, seed=7)
    module = cpu_kernels()
    packed = module.pack_weight(w)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 8):
            torch.set_num_threads(threads)
            results.append(module.packed_linear(x, packed, 200, b))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)


@needs_kernel
def test_the_packed_matmul_refuses_a_copy_of_another_shape():
    module = cpu_kernels()
    x, w, _ = _case(4, 64, 32, seed=1)
    packed = module.pack_weight(w)
    with pytest.raises(RuntimeError, match="pack_weight"):
        module.packed_linear(torch.randn(4, 31), packed, 64, torch.empty(0))
    with pytest.raises(RuntimeError, match="pack_weight"):
        module.packed_linear(x, packed, 65, torch.empty(0))
    with pytest.raises(RuntimeError, match="float32"):
        module.pack_weight(w.double())


@needs_kernel
@pytest.mark.parametrize("rows", [1, 40, 192, 193])
def test_linear_takes_the_packed_copy_up_to_its_row_limit(rows):
    x, w, b = _case(rows, 96, 48, seed=rows)
    module = cpu_kernels()
    assert module.PACKED_MAX_ROWS == 192
    # A copy of another weight tells which path ran: the copy's product, or the weight's.
    other = torch.randn(96, 48)
    got = linear(x, w, b, packed=module.pack_weight(other))
    want = other if rows <= 192 else w
    torch.testing.assert_close(got, torch.nn.functional.linear(x, want, b), rtol=1e-5,
                               atol=1e-5)


@needs_kernel
def test_a_weight_keeps_its_packed_copy_until_it_is_written(monkeypatch):
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    w = torch.randn(64, 16)
    first = packed_weights.packed(w)
    assert first is not None and packed_weights.packed(w) is first
    with torch.no_grad():
        w.mul_(2)
    second = packed_weights.packed(w)
    assert second is not first
    x = torch.randn(3, 16)
    torch.testing.assert_close(linear(x, w, packed=second), x @ w.T, rtol=1e-5, atol=1e-5)
    w.data = torch.randn(64, 16)  # new data, as a model moved or cast in place gets
    third = packed_weights.packed(w)
    assert third is not second
    torch.testing.assert_close(linear(x, w, packed=third), x @ w.T, rtol=1e-5, atol=1e-5)
    packed_weights.forget(w)
    assert not hasattr(w, "_conveyor_packed")


@needs_kernel
@pytest.mark.parametrize("switch", ["unpacked", "blas"])
def test_no_packed_copy_where_packing_is_switched_off(switch, monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, switch)
    assert packed_weights.packed(torch.randn(64, 16)) is None


@needs_kernel
def test_no_packed_copy_of_a_weight_the_kernel_does_not_take(monkeypatch):
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    assert packed_weights.packed(torch.randn(64, 16, dtype=torch.bfloat16)) is None
    assert packed_weights.packed(torch.randn(64)) is None
