"""Paged attention and decode graphs on CUDA: the Triton kernel against the torch reference
in the GPU's dtypes, and replayed decode steps against eager ones (skipped without CUDA)."""

from __future__ import annotations

import random

import pytest
import torch
from test_paged_attention import CASES, make_case, reference, run

from worker import Engine, SamplingParams

KERNEL_DTYPES = {"float32": (torch.float32, 2e-6), "bfloat16": (torch.bfloat16, 2e-2),
                 "float16": (torch.float16, 2e-3)}


@pytest.mark.parametrize("dtype_name", list(KERNEL_DTYPES))
@pytest.mark.parametrize("case_name", list(CASES))
def test_the_triton_kernel_on_cuda_equals_the_reference(case_name, dtype_name):
    from worker.attention.paged_triton import paged_attention

    dtype, atol = KERNEL_DTYPES[dtype_name]
    heads, kv_heads, head_dim, block_size, q_lens, seq_lens = CASES[case_name]
    case = make_case(heads, kv_heads, head_dim, block_size, q_lens, seq_lens, dtype, seed=2)
    want = run(reference, case, head_dim**-0.5)
    got = run(paged_attention, case, head_dim**-0.5, "cuda")
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=0)


def test_replayed_decode_steps_equal_eager_ones_in_float32(tiny_llama):
    """Every batch size from 1 to past the largest bucket (requests finish one by one), with
    sampled, seeded and penalised requests: the tokens of an engine that replays its decode
    steps are those of one that launches them, and the graphs were used. A replay pads its
    batch to the bucket, and a matmul of other rows may round otherwise: greedy tokens may
    part only at a near-tie of the eager run's top two, seeded draws agree on most tokens."""
    rng = random.Random(3)
    work = [[rng.randrange(2, 1000) for _ in range(rng.randint(1, 80))] for _ in range(40)]
    params = [SamplingParams(max_tokens=8 + i, ignore_eos=True, seed=i, logprobs=2,
                             temperature=0.0 if i % 2 == 0 else 0.9, top_p=0.95,
                             presence_penalty=0.3 if i % 5 == 0 else 0.0) for i in range(40)]
    settings = dict(device="cuda", dtype="float32", max_num_seqs=36)
    graphed = Engine(tiny_llama, **settings)
    eager = Engine(tiny_llama, enforce_eager=True, **settings)
    assert eager.runner.graphs is None
    assert graphed.runner.graphs.buckets == [1, 2, 4, 8, 16, 32, 36]
    stats = graphed.stats()
    assert stats["cuda_graph_buckets"] == 7 and stats["cuda_graph_memory_bytes"] > 0
    got = graphed.generate(work, params)
    want = eager.generate(work, params)
    assert graphed.stats()["cuda_graph_replays"] > 30
    sampled = agreed = 0
    for p, ref, out in zip(params, want, got, strict=True):
        same = next((k for k, (a, b) in enumerate(zip(ref.token_ids, out.token_ids,
                                                      strict=True)) if a != b),
                    len(ref.token_ids))
        if p.temperature == 0.0:
            if same < len(ref.token_ids):
                (_, first), (_, second) = ref.logprobs[same].top
                assert first - second <= 1e-3, f"greedy tokens parted at {same} decisively"
        else:
            sampled += len(ref.token_ids)
            agreed += same
    assert agreed > 0.8 * sampled
