"""The greedy pick's native kernel (csrc/argmax_rows.cpp): the same index as torch.argmax
on every row, for ties inside a vector, across vectors and in the tail, for rows holding
NaN or nothing but -inf, at vocabularies that are and are not multiples of the vector
width; and the sampler's greedy rows go through it."""

from __future__ import annotations

import pytest
import torch
from kernel_fixtures import needs_kernel

from producer.wire.params import SamplingParams
from worker.host.cpu_kernels import cpu_kernels
from worker.sampling import sampler as sampler_module
from worker.sampling.sampler import Sampler, SampleRequest


def _rows(vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Few distinct values, so that maxima repeat across lanes, vectors and the tail.
    return torch.randint(0, 5, (24, vocab), generator=gen).float()


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 3, 15, 16, 17, 33, 100, 8192, 32003])
def test_the_kernel_picks_what_torch_argmax_picks(vocab):
    kernel = cpu_kernels().argmax_rows
    for seed in range(3):
        x = _rows(vocab, seed)
        assert torch.equal(kernel(x), x.argmax(dim=-1))
        x = torch.randn(24, vocab, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(kernel(x), x.argmax(dim=-1))


@needs_kernel
@pytest.mark.parametrize("where", [0, 5, 16, 40, 98])
def test_a_nan_is_picked_as_torch_picks_it(where):
    x = torch.randn(3, 100)
    x[1, where] = float("nan")
    x[1, 99] = float("nan")
    x[2, :] = float("-inf")
    got = cpu_kernels().argmax_rows(x)
    assert got[1].item() == where  # the first NaN, as torch.argmax
    assert torch.equal(got, x.argmax(dim=-1))


@needs_kernel
def test_edge_values_are_picked_as_torch_picks_them():
    rows = []
    for vocab in (5, 40):  # all in the scalar tail, and across vectors and a tail
        zeros = torch.zeros(vocab)
        zeros[1] = -0.0  # -0.0 equals +0.0: the first of them wins
        inf = torch.randn(vocab)
        inf[3] = float("inf")
        inf[4] = float("inf")
        tail_nan = torch.randn(vocab)
        tail_nan[0] = 100.0
        tail_nan[-1] = float("nan")  # a NaN after a larger value still wins
        rows += [zeros, inf, tail_nan]
    kernel = cpu_kernels().argmax_rows
    for row in rows:
        x = row[None, :]
        assert torch.equal(kernel(x), x.argmax(dim=-1)), row
    empty = torch.empty(0, 32)
    assert kernel(empty).shape == (0,)


@needs_kernel
def test_the_kernel_reads_a_view_of_other_strides():
    x = torch.randn(40, 300)[::3, 7:250]
    assert torch.equal(cpu_kernels().argmax_rows(x), x.argmax(dim=-1))


@needs_kernel
def test_greedy_rows_go_through_the_kernel(monkeypatch):
    calls = []
    real = sampler_module.argmax_rows_kernel()

    def spy(logits):
        calls.append(logits.shape)
        return real(logits)

    monkeypatch.setattr(sampler_module, "argmax_rows_kernel", lambda: spy)
    logits = torch.randn(4, 64)
    greedy = SamplingParams(temperature=0.0)
    sampled = SamplingParams(temperature=1.0)
    rows = [SampleRequest(greedy, 0, 0), SampleRequest(sampled, 1, 0),
            SampleRequest(greedy, 2, 0), SampleRequest(greedy, 3, 0)]
    tokens, _ = Sampler()(logits, rows)
    assert calls == [torch.Size([3, 64])]  # the greedy rows only
    want = logits.argmax(dim=-1)
    assert [tokens[i] for i in (0, 2, 3)] == [want[i].item() for i in (0, 2, 3)]
    tokens, _ = Sampler()(logits, [SampleRequest(greedy, i, 0) for i in range(4)])
    assert calls[-1] == torch.Size([4, 64]) and tokens == want.tolist()
