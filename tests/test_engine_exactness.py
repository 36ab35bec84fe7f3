"""The engine's greedy output equals transformers' greedy generate, on every scheduling path."""

from __future__ import annotations

import random

import pytest
from hf_reference import Reference, hf_greedy

from scheduler.step_cost import MIN_PREFILL_TOKENS
from worker import Engine, SamplingParams
from worker.host.cpu_kernels import decode_layers_kernel

NUM_PROMPTS = 24

VARIANTS = {
    "llama": dict(arch="llama", tie_word_embeddings=False),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "qwen2": dict(arch="qwen2"),
    "mistral": dict(arch="mistral"),
    "llama-mqa": dict(arch="llama", num_kv_heads=1),
    "llama-sharded": dict(arch="llama", num_shards=3),
    "llama3-rope": dict(
        arch="llama",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
}

# (name, engine settings, how requests arrive)
# Room for the whole workload at once (24 x 364 tokens at most), so nothing is preempted.
POOL = dict(num_kv_blocks=24 * 23 + 8, block_size=16)
PATHS = {
    "all-at-once-large-budget": (dict(max_num_batched_tokens=2048, **POOL), "together"),
    "chunked-shuffled-nan": (
        dict(max_num_batched_tokens=64, block_shuffle_seed=7, **POOL), "together"),
    "arriving-between-steps": (dict(max_num_batched_tokens=64, **POOL), "staggered"),
    # Step N+1 scheduled while step N runs (worker/engine/step_pipeline.py), its inputs pending.
    "overlapped-chunked-nan": (
        dict(max_num_batched_tokens=64, block_shuffle_seed=7, async_scheduling=True, **POOL),
        "staggered"),
    "staggered-large-budget": (dict(max_num_batched_tokens=2048, **POOL), "staggered"),
}
# Every path runs with and without an inter-token target. The target no step meets: once
# the cost model learnt (scheduler/step_cost.py), every prompt beside decodes goes in the
# smallest chunks (overlapped steps: timed on the runner thread).
TARGETS = {"no-target": {}, "itl-target": dict(itl_target_ms=1e-6)}


def workload(vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """24 prompts of 1 to 300 tokens with max_tokens 1 to 64 (both ends included)."""
    rng = random.Random(seed)
    lengths = [1, 300] + [rng.randint(1, 300) for _ in range(NUM_PROMPTS - 2)]
    maxes = [64, 1] + [rng.randint(1, 64) for _ in range(NUM_PROMPTS - 2)]
    return [([rng.randrange(2, vocab_size) for _ in range(n)], m)
            for n, m in zip(lengths, maxes, strict=True)]


_REFERENCES: dict[tuple[str, int], list[Reference]] = {}


def references(model_dir, work, seed: int = 0) -> list[Reference]:
    """transformers' outputs for the workload, computed once per model and seed."""
    key = (str(model_dir), seed)
    if key not in _REFERENCES:
        _REFERENCES[key] = [hf_greedy(model_dir, p, m) for p, m in work]
    return _REFERENCES[key]


def run_engine(engine: Engine, work, arrival: str, nan_free_blocks: bool) -> dict:
    """Serve the workload; returns outputs plus what the steps looked like."""
    pending = list(enumerate(work))
    ids: dict[str, int] = {}
    tokens: dict[int, list[int]] = {}

    def add_next():
        i, (prompt, max_tokens) = pending.pop(0)
        ids[engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))] = i

    # Record what each step held: its chunks are decodes (True) or prefill chunks (False);
    # and the prompt tokens of each step beside decodes scheduled with the cost learnt.
    step_kinds: list[list[bool]] = []
    sized: list[int] = []
    schedule = engine.scheduler.schedule

    def recording_schedule(**kwargs):
        ready = engine.scheduler.step_cost.ready
        out = schedule(**kwargs)
        step_kinds.append([c.is_decode for c in out.chunks])
        if ready and any(step_kinds[-1]):
            sized.append(sum(c.num_tokens for c in out.chunks
                             if not c.is_decode and c.num_tokens > 1))
        return out

    engine.scheduler.schedule = recording_schedule
    while pending and arrival == "together":
        add_next()
    while pending or engine.has_unfinished():
        if pending:
            add_next()
        if nan_free_blocks:
            engine.kv_cache.fill_blocks_(engine.block_pool.free_block_ids(), float("nan"))
        for out in engine.step():
            tokens.setdefault(ids[out.request_id], []).extend(out.new_token_ids)
    engine.scheduler.schedule = schedule
    mixed_steps = sum(any(k) and not all(k) for k in step_kinds)
    return {"tokens": [tokens.get(i, []) for i in range(len(work))], "mixed_steps": mixed_steps,
            "sized_prefill": sized}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("target", list(TARGETS))
def test_greedy_float64_equals_transformers(model_factory, variant, path, target):
    model_dir = model_factory(variant, preset="tiny", **VARIANTS[variant])
    settings, arrival = PATHS[path]
    settings = {**settings, **TARGETS[target]}
    engine = Engine(model_dir, dtype="float64", **settings)
    work = workload(engine.model_config.vocab_size)
    refs = references(model_dir, work)

    # Counted by the model itself, not by the runner's bookkeeping: every forward (the
    # runner's model.logits included) embeds its tokens once.
    forwards: list[int] = []
    engine.model.model.embed_tokens.register_forward_hook(lambda *_: forwards.append(1))
    result = run_engine(engine, work, arrival, nan_free_blocks="nan" in path)

    for i, (ref, got) in enumerate(zip(refs, result["tokens"], strict=True)):
        assert got == ref.token_ids, f"prompt {i} ({len(work[i][0])} tokens) diverged"
    assert len(forwards) == engine.num_steps > 0  # one forward per step
    if settings["max_num_batched_tokens"] == 64:
        assert result["mixed_steps"] > 0  # decodes shared steps with prefill chunks
    if settings.get("async_scheduling"):
        assert engine.num_overlapped_steps > engine.num_steps // 2
    if settings.get("itl_target_ms"):  # the target (no step meets it) held prompts to the floor
        assert engine.scheduler.step_cost.ready and result["mixed_steps"] > 0
        assert max(result["sized_prefill"]) <= MIN_PREFILL_TOKENS
        if arrival == "staggered":  # (prompts arriving beside decodes, once it learnt)
            assert sum(result["sized_prefill"]) > MIN_PREFILL_TOKENS
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    engine.close()


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_greedy_float32_matches_wherever_the_reference_is_decisive(model_factory, variant,
                                                                   target):
    """float32 on the CPU: decode steps, and small steps with prefill chunks, take the native
    call (worker/models/native_decode.py) where it is built."""
    model_dir = model_factory(variant, preset="tiny", **VARIANTS[variant])
    engine = Engine(model_dir, dtype="float32", max_num_batched_tokens=64, **POOL,
                    **TARGETS[target])
    work = workload(engine.model_config.vocab_size, seed=1)
    refs = references(model_dir, work, seed=1)
    got = run_engine(engine, work, "together", nan_free_blocks=False)["tokens"]
    compared = 0
    for ref, tokens in zip(refs, got, strict=True):
        for k, (a, b) in enumerate(zip(ref.token_ids, tokens, strict=False)):
            if a != b:
                # A near-tie in the reference may flip in float32; nothing after it is comparable.
                assert ref.gaps[k] <= 1e-3, f"diverged at token {k} with a decisive gap"
                break
            compared += 1
    assert compared > 0.9 * sum(len(r.token_ids) for r in refs)
    # Decode steps, and steps with prefill chunks, took the native layers
    # (worker/models/native_decode.py) where built.
    assert engine.model.num_native_mixed_steps > 0 or decode_layers_kernel() is None
    if TARGETS[target]:
        assert engine.scheduler.step_cost.ready


@pytest.mark.parametrize("variant", ["llama", "llama-mqa"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_greedy_float64_equals_transformers_on_the_torch_decode_path(model_factory, variant,
                                                                     target, monkeypatch):
    """The path decodes take where the CPU kernel is switched off or cannot be built (and on
    every other device): gathered context and fused scaled-dot-product attention."""
    monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "0")
    model_dir = model_factory(variant, preset="tiny", **VARIANTS[variant])
    settings, arrival = PATHS["chunked-shuffled-nan"]
    engine = Engine(model_dir, dtype="float64", **settings, **TARGETS[target])
    work = workload(engine.model_config.vocab_size)
    result = run_engine(engine, work, arrival, nan_free_blocks=True)
    for i, (ref, got) in enumerate(zip(references(model_dir, work), result["tokens"],
                                       strict=True)):
        assert got == ref.token_ids, f"prompt {i} ({len(work[i][0])} tokens) diverged"


@pytest.mark.parametrize("variant", ["llama", "llama-mqa"])
@pytest.mark.parametrize("path", ["chunked-shuffled-nan", "overlapped-chunked-nan"])
def test_greedy_float64_equals_transformers_through_paged_attention(model_factory, variant,
                                                                    path):
    """The "paged" backend (attention through the block tables in place; on the CPU the
    torch reference of the kernel the GPU runs): chunked prefill beside decodes, prompts
    whose blocks are reused by later ones, free blocks full of NaN, overlapped steps."""
    model_dir = model_factory(variant, preset="tiny", **VARIANTS[variant])
    settings, arrival = PATHS[path]
    engine = Engine(model_dir, dtype="float64", attention_backend="paged", **settings)
    assert type(engine.model.model.layers[0].self_attn.attn).__name__ == "PagedAttention"
    work = workload(engine.model_config.vocab_size)
    result = run_engine(engine, work, arrival, nan_free_blocks=True)
    for i, (ref, got) in enumerate(zip(references(model_dir, work), result["tokens"],
                                       strict=True)):
        assert got == ref.token_ids, f"prompt {i} ({len(work[i][0])} tokens) diverged"
    assert result["mixed_steps"] > 0
    engine.close()


@pytest.mark.parametrize("path", ["chunked-shuffled-nan", "overlapped-chunked-nan"])
def test_decode_steps_over_the_graphs_static_buffers_equal_transformers(model_factory, path):
    """The discipline a CUDA graph's replay relies on (worker/models/decode_graphs.py), run
    on the CPU with nothing captured: every decode step that fits goes through the static
    buffers, padded to its bucket (rows of no length writing to the spare block), and the
    greedy tokens are still transformers'."""
    from worker.models.decode_graphs import DecodeGraphs

    model_dir = model_factory("llama", preset="tiny", **VARIANTS["llama"])
    settings, arrival = PATHS[path]
    engine = Engine(model_dir, dtype="float64", attention_backend="paged", **settings)
    assert engine.runner.graphs is None  # nothing is captured on a CPU
    graphs = engine.runner.graphs = DecodeGraphs(engine.model, engine.kv_cache, engine.device,
                                                 max_batch=20,
                                                 max_model_len=engine.max_model_len,
                                                 capture=False)
    assert graphs.buckets == [1, 2, 4, 8, 16, 20]
    spare = engine.block_pool.num_blocks
    engine.kv_cache.fill_blocks_([spare], float("nan"))
    padded = []
    run = graphs.run
    graphs.run = lambda meta: padded.append(graphs.bucket(len(meta.query_lens))
                                            > len(meta.query_lens)) or run(meta)
    work = workload(engine.model_config.vocab_size)
    result = run_engine(engine, work, arrival, nan_free_blocks=True)
    for i, (ref, got) in enumerate(zip(references(model_dir, work), result["tokens"],
                                       strict=True)):
        assert got == ref.token_ids, f"prompt {i} ({len(work[i][0])} tokens) diverged"
    # Decode steps went through the buffers, some padded, whose rows wrote the spare block.
    assert graphs.replays == len(padded) > 10 and any(padded) and not all(padded)
    assert not engine.kv_cache.k[0][spare].isnan().all()
    engine.close()
