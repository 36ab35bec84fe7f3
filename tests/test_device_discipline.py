"""Every tensor a step makes is made on the device of the data it meets.

On a CPU a tensor made without a device lands on the CPU too, so a forgotten ``device=``
goes unseen until the first GPU run crashes. Here the default device is ``meta`` while
the engine steps: any tensor created without an explicit device is a meta tensor, and
the first operation mixing it with real data fails. The steps cover greedy, sampled,
seeded, penalised and biased rows, logprobs, swaps and prefix-cache hits, and their
tokens must equal the same run without the trap.
"""

from __future__ import annotations

import random

import pytest
import torch

from worker import Engine, SamplingParams

SHARED = [random.Random(1).randrange(2, 1000) for _ in range(48)]  # a prefix of 3 blocks


def workload() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(0)
    kinds = [
        {"temperature": 0.0},
        {"temperature": 0.8, "seed": 3},
        {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 4},
        {"temperature": 0.7, "min_p": 0.05, "seed": 5, "logprobs": 2},
        {"temperature": 0.0, "presence_penalty": 0.5, "repetition_penalty": 1.3},
        {"temperature": 0.9, "frequency_penalty": 0.4, "logit_bias": {7: 5.0}, "seed": 6},
    ]
    work = []
    for i in range(24):
        prompt = SHARED + [rng.randrange(2, 1000) for _ in range(rng.randint(4, 60))]
        work.append((prompt, SamplingParams(max_tokens=rng.randint(8, 40), ignore_eos=True,
                                            **kinds[i % len(kinds)])))
    return work


def run(engine: Engine, work) -> list[list[int]]:
    return [c.token_ids for c in engine.generate([p for p, _ in work], [s for _, s in work])]


@pytest.fixture
def trapped():
    """While active, tensors made without a device are meta tensors."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def test_no_step_makes_a_tensor_without_a_device(tiny_llama, trapped):
    work = workload()
    torch.set_default_device(None)
    free = run(Engine(tiny_llama, dtype="float32", num_kv_blocks=400, max_num_seqs=32), work)
    # A pool too small for the batch: preemption swaps KV out and back.
    engine = Engine(tiny_llama, dtype="float32", num_kv_blocks=60, max_num_seqs=32,
                    swap_blocks=400, preemption_mode="swap", max_num_batched_tokens=256)
    torch.set_default_device("meta")
    assert torch.empty(1).device.type == "meta"  # the trap is set

    trapped_out = run(engine, work)

    stats = engine.stats()
    assert stats["preemptions_swap"] > 0 and stats["swapped_in_blocks"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert trapped_out == free
