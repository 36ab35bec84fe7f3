"""W4 memory pressure on the small preset: unconstrained, swap, recompute (throughput).

Measure with: .venv/bin/pytest tests/benchmarks/test_bench_memory.py --benchmark-only
"""

from __future__ import annotations

import pytest

from worker import Engine, SamplingParams
from worker.bench.run.workloads import kv_blocks_needed, w1_heavy_tailed

MODES = {
    "unconstrained": dict(pool_share=1.0, preemption_mode="auto"),
    "swap": dict(pool_share=0.25, preemption_mode="swap"),
    "recompute": dict(pool_share=0.25, preemption_mode="recompute"),
}


@pytest.fixture(scope="module")
def small_model(model_factory):
    return model_factory("small", preset="small", arch="llama")


@pytest.mark.parametrize("mode", list(MODES))
def test_bench_w4_memory_pressure(benchmark, small_model, mode):
    # The CI smoke run (--benchmark-disable) serves a quarter of W1: it checks, not measures.
    work = w1_heavy_tailed(num_requests=16 if benchmark.disabled else 64)
    settings = MODES[mode]
    pool = int(kv_blocks_needed(work) * settings["pool_share"]) + 1
    prompts = [w.prompt_token_ids for w in work]
    params = [SamplingParams(max_tokens=w.max_tokens, temperature=0, ignore_eos=True) for w in work]

    def serve():
        engine = Engine(small_model, num_kv_blocks=pool, max_num_seqs=64,
                        num_threads=1 if benchmark.disabled else 2,
                        preemption_mode=settings["preemption_mode"], swap_blocks=pool * 4,
                        max_num_batched_tokens=1024, enable_prefix_caching=False)
        done = engine.generate(prompts, params)
        return engine, sum(len(c.token_ids) for c in done)

    engine, tokens = benchmark.pedantic(serve, rounds=1, iterations=1)
    stats = engine.stats()
    benchmark.extra_info.update(output_tokens=tokens, preemptions_swap=stats["preemptions_swap"],
                                preemptions_recompute=stats["preemptions_recompute"])
    assert tokens == sum(w.max_tokens for w in work)
    if mode != "unconstrained":
        assert stats["preemptions"] > 0
