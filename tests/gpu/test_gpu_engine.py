"""The engine on a CUDA device: greedy against transformers, sampling, seeds, swaps and
prefix hits, in bfloat16 and float32 (skipped without CUDA; see conftest.py)."""

from __future__ import annotations

import random

import pytest
import torch

from worker import Engine, SamplingParams
from worker.bench.step_copies import KINDS, host_to_device_copies, kind_engine

DTYPES = ["float32", "bfloat16"]
# A reference near-tie (top-two logit gap below this) may flip between two correct
# implementations in reduced precision: nothing after it is compared.
NEAR_TIE = {"float32": 1e-3, "bfloat16": 0.1}


def prompts(vocab: int, n: int = 12, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(1, 300))] for _ in range(n)]


# transformers' models and answers, made once a session (each mode compares with the same).
_HF_MODELS: dict[tuple[str, str], object] = {}
_HF_ANSWERS: dict[tuple[str, str, tuple[int, ...], int], tuple[list[int], list[float]]] = {}


def hf_greedy_on_cuda(model_dir, dtype: str, prompt: list[int], max_tokens: int):
    """transformers' greedy tokens and top-two gaps, on the same device and dtype."""
    key = (str(model_dir), dtype, tuple(prompt), max_tokens)
    if key not in _HF_ANSWERS:
        _HF_ANSWERS[key] = _hf_greedy(model_dir, dtype, prompt, max_tokens)
    return _HF_ANSWERS[key]


@torch.inference_mode()
def _hf_greedy(model_dir, dtype: str, prompt: list[int], max_tokens: int):
    from transformers import AutoModelForCausalLM

    if (str(model_dir), dtype) not in _HF_MODELS:
        _HF_MODELS[str(model_dir), dtype] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)).to("cuda").eval()
    model = _HF_MODELS[str(model_dir), dtype]
    out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=max_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                   device="cuda"),
                         pad_token_id=model.generation_config.eos_token_id)
    gaps = [float(torch.topk(step[0].float(), 2).values.diff().abs()) for step in out.logits]
    return out.sequences[0, len(prompt):].tolist(), gaps


# How decode steps run on CUDA: the default (paged attention, decode steps replayed from
# CUDA graphs), the same launched eagerly, and the gathering torch backend.
MODES = {"graphs": {}, "eager": dict(enforce_eager=True),
         "torch": dict(attention_backend="torch")}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_matches_transformers_on_cuda(tiny_llama, dtype, mode):
    """Every greedy token equals transformers' on the same device and dtype, but at a
    near-tie of the reference's top two logits, where two correct kernels may round either
    way; past such a tie the engine resumes on the reference's own token, so every token
    after it is compared too."""
    engine = Engine(tiny_llama, device="cuda", dtype=dtype, max_num_batched_tokens=64,
                    **MODES[mode])
    graphs = engine.runner.graphs
    assert (graphs is not None) == (mode == "graphs")
    work = prompts(engine.model_config.vocab_size)
    compared = total = ties = 0
    for prompt in work:
        ref, gaps = hf_greedy_on_cuda(tiny_llama, dtype, prompt, 32)
        total += len(ref)
        at = 0
        while at < len(ref):
            params = SamplingParams(max_tokens=len(ref) - at, temperature=0, ignore_eos=True)
            [got] = engine.generate([prompt + ref[:at]], [params])
            parted = next((k for k, (a, b) in enumerate(zip(ref[at:], got.token_ids,
                                                            strict=True)) if a != b), None)
            if parted is None:
                compared += len(ref) - at
                break
            compared += parted
            assert gaps[at + parted] <= NEAR_TIE[dtype], \
                f"parted at token {at + parted} with a decisive gap"
            ties += 1
            at += parted + 1
    assert compared + ties == total and compared > 0.8 * total
    if graphs is not None:
        assert engine.stats()["cuda_graph_replays"] > 0 and graphs.graphs


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampled_and_seeded_requests_run_and_repeat_in_any_batch(tiny_llama, dtype):
    engine = Engine(tiny_llama, device="cuda", dtype=dtype)
    kinds = [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9),
             dict(temperature=1.0, top_k=20, min_p=0.05),
             dict(temperature=0.7, presence_penalty=0.5, logit_bias={5: 3.0}, logprobs=2)]
    seeded = SamplingParams(max_tokens=24, seed=1234, ignore_eos=True, **kinds[1])
    prompt = [5, 6, 7, 8, 9]
    [alone] = engine.generate([prompt], [seeded])
    others = [SamplingParams(max_tokens=24, ignore_eos=True, **k) for k in kinds]
    batch = engine.generate([prompt] + [[9, 10 + i] for i in range(4)], [seeded] + others)
    assert batch[0].token_ids == alone.token_ids
    assert all(len(c.token_ids) == 24 for c in batch)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_forced_swaps_and_prefix_hits_keep_outputs(tiny_llama, dtype, mode):
    """A run that swaps and hits the prefix cache gives the tokens of one that does neither.

    The two runs batch differently, and a GPU's (or bfloat16's) matmuls round by shape: in
    float32 the tokens must be equal; in bfloat16 a greedy request may part from the other
    run only at a near-tie of that run's top two logits, and seeded sampled requests must
    agree on most of their tokens (a draw that lands within rounding of a bucket's edge
    takes its neighbour)."""
    shared = list(range(2, 50))
    work = [shared + [100 + i] * (i + 1) for i in range(24)]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0 if i % 2 else 0.9,
                             seed=i, logprobs=2) for i in range(24)]
    free = Engine(tiny_llama, device="cuda", dtype=dtype, num_kv_blocks=400, **MODES[mode])
    tight = Engine(tiny_llama, device="cuda", dtype=dtype, num_kv_blocks=60, swap_blocks=400,
                   preemption_mode="swap", max_num_batched_tokens=256, **MODES[mode])
    want = free.generate(work, params)
    got = tight.generate(work, params)
    stats = tight.stats()
    assert stats["preemptions_swap"] > 0 and stats["swapped_in_blocks"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    if dtype == "float32":
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        return
    sampled_total = sampled_agreed = 0
    for p, ref, out in zip(params, want, got, strict=True):
        agreed = next((k for k, (a, b) in enumerate(zip(ref.token_ids, out.token_ids,
                                                            strict=True))
                       if a != b), len(ref.token_ids))
        if p.temperature == 0.0:
            if agreed < len(ref.token_ids):
                (_, first), (_, second) = ref.logprobs[agreed].top
                assert first - second <= NEAR_TIE[dtype], \
                    f"greedy tokens parted at {agreed} with a decisive gap"
        else:
            sampled_total += len(ref.token_ids)
            sampled_agreed += agreed
    assert sampled_agreed > 0.8 * sampled_total


@pytest.mark.parametrize("dtype", DTYPES)
def test_overlapped_steps_are_the_default_and_match_plain_steps(tiny_llama, dtype):
    """Steps scheduled while the step before runs (on by default on CUDA) give exactly the
    tokens of plain steps: sampled, seeded, under swaps and starved steps."""
    rng = random.Random(1)
    work = [[rng.randrange(2, 1000) for _ in range(rng.randint(8, 120))] for _ in range(32)]
    params = [SamplingParams(max_tokens=rng.randint(8, 48), ignore_eos=True, seed=i,
                             temperature=0.0 if i % 2 else 0.8, top_p=0.95) for i in range(32)]
    settings = dict(device="cuda", dtype=dtype, num_kv_blocks=80, swap_blocks=400,
                    preemption_mode="auto", max_num_batched_tokens=256)
    overlapped, plain = Engine(tiny_llama, **settings), Engine(tiny_llama, async_scheduling=False,
                                                              **settings)
    assert overlapped.async_scheduling and not plain.async_scheduling
    want = [c.token_ids for c in plain.generate(work, params)]
    got = [c.token_ids for c in overlapped.generate(work, params)]
    assert overlapped.num_overlapped_steps > 0 and overlapped.stats()["preemptions"] > 0
    assert got == want
    assert overlapped.block_pool.num_free == overlapped.block_pool.num_blocks
    overlapped.close()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_step_moves_its_inputs_to_the_device_in_one_copy(tiny_llama, kind):
    """Token ids, positions, slot mapping, block tables, the attention plan's indices,
    sampling values, penalty tokens, logit bias and row subsets: one pinned copy a step,
    for greedy, sampled, penalised and prefill-and-decode steps (no swaps here)."""
    engine = kind_engine(tiny_llama, kind, "bfloat16")
    copies = host_to_device_copies(engine, steps=4)
    assert copies == {"Memcpy HtoD (Pinned -> Device)": 4}, dict(copies)
    engine.close()


def test_decode_steps_run_a_fused_attention_kernel_but_cudnns(tiny_llama):
    """The torch backend: cuDNN's attention builds a plan for every new shape, and a
    decode's context grows every step (~9.5 ms of host time a call on an H200): bfloat16
    steps, where torch would pick it, run another fused kernel, not the math one (which
    rounds the scores). (The paged backend, CUDA's default, calls none of them.)"""
    from torch.profiler import ProfilerActivity, profile

    engine = Engine(tiny_llama, device="cuda", dtype="bfloat16", async_scheduling=False,
                    attention_backend="torch")
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # switched off for the process
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i in range(8):
        engine.add_request([5 + i] * (20 + 7 * i), params)
    for _ in range(3):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            engine.step()
    ops = {event.key for event in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in ops
    assert not any("cudnn_attention" in op or "attention_math" in op for op in ops), sorted(ops)
    assert any("efficient_attention" in op or "flash_attention" in op for op in ops), sorted(ops)
    engine.close()


@pytest.mark.parametrize("dtype", DTYPES)
def test_constrained_answers_validate_on_the_device(tiny_llama, dtype):
    """A JSON schema held on CUDA: the masks made while the forward runs, copied after it,
    applied by the byte table's bias: every answer parses against the schema and ends
    stop."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "maximum": 99},
        "kind": {"enum": ["a", "b", "c"]}}, "required": ["name", "n", "kind"],
        "additionalProperties": False}
    form = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    params = [SamplingParams(max_tokens=128, temperature=1.0, seed=i, response_format=form)
              for i in range(8)]
    engine = Engine(tiny_llama, device="cuda", dtype=dtype)
    done = engine.generate(prompts(1024, 8), params)
    for c in done:
        assert str(c.finish_reason) == "stop", c
        jsonschema.validate(json.loads(c.text), schema)
    engine.close()
