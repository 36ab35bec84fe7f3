"""Prompt logprobs (``echo`` on the gateway's completions): each prompt token's logprob
given the tokens before it, computed in the prefill in the model's dtype, equal to
transformers' float64 ``log_softmax`` within 1e-6 on every path that computes a prompt: one
step, a chunked prefill, a prompt whose prefix is cached, overlapped steps, beside other
requests, and a request preempted before its first token."""

from __future__ import annotations

import random

import pytest
import torch
from hf_reference import _load

from worker import Engine, SamplingParams

TOLERANCE = 1e-6


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]


@torch.inference_mode()
def reference(model_dir, ids: list[int], k: int) -> tuple[list[float], list[list[int]]]:
    """transformers' float64 logprob of each prompt token after the first, and the ids of
    the k most likely tokens there."""
    logits = _load(str(model_dir))(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
    return chosen, torch.topk(logp[:-1], k).indices.tolist() if k else [[]] * (len(ids) - 1)


def check(model_dir, done, ids: list[int], k: int) -> None:
    assert done.prompt_token_ids == ids
    got = done.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    want, top = reference(model_dir, ids, k)
    assert [lp.token_id for lp in got[1:]] == ids[1:]
    assert max(abs(lp.logprob - w) for lp, w in zip(got[1:], want, strict=True)) < TOLERANCE
    for lp, ref_top in zip(got[1:], top, strict=True):
        assert [t for t, _ in lp.top] == ref_top and len(lp.top) == k


@pytest.mark.parametrize("settings", [
    dict(max_num_batched_tokens=512),
    dict(max_num_batched_tokens=16, max_num_seqs=4),  # chunked: a prompt of 70 in chunks
    dict(max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=True),
])
def test_prompt_logprobs_equal_transformers_float64(tiny_llama, settings):
    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=256, **settings)
    ids = prompt(70)
    others = [prompt(9 + i, seed=i + 1) for i in range(3)]  # beside requests without them
    done, *rest = engine.generate([ids, *others], [
        SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2),
        *[SamplingParams(max_tokens=5, temperature=0)] * 3])
    check(tiny_llama, done, ids, 2)
    assert all(r.prompt_logprobs is None for r in rest)
    (alone,) = engine.generate([ids], SamplingParams(max_tokens=3, temperature=0))
    assert done.token_ids == alone.token_ids  # the output is the same with or without


def test_rows_projected_a_block_at_a_time_give_the_same_logprobs(tiny_llama, monkeypatch):
    """A prompt's rows go to logits in blocks (bounded memory): blocks of 7 rows, a prompt
    of 70 in one step, several requests in it; equal to transformers all the same."""
    from worker.sampling import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_BLOCK", 7)
    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=256,
                    max_num_batched_tokens=512)
    prompts = [prompt(70), prompt(23, seed=3)]
    done = engine.generate(prompts, [SamplingParams(max_tokens=2, temperature=0,
                                                    prompt_logprobs=k) for k in (3, 0)])
    for ids, got, k in zip(prompts, done, (3, 0), strict=True):
        check(tiny_llama, got, ids, k)


def test_a_cached_prefix_is_computed_again_for_its_logprobs(tiny_llama):
    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=256, block_size=16)
    ids = prompt(60)
    engine.generate([ids], SamplingParams(max_tokens=2, temperature=0))
    (hit,) = engine.generate([ids], SamplingParams(max_tokens=2, temperature=0))
    assert hit.usage.cached_tokens >= 48  # precondition: the prefix is in the cache
    (done,) = engine.generate([ids], SamplingParams(max_tokens=2, temperature=0,
                                                    prompt_logprobs=0))
    assert done.usage.cached_tokens == 0
    check(tiny_llama, done, ids, 0)
    assert done.token_ids == hit.token_ids


def test_a_request_preempted_in_its_prefill_keeps_one_logprob_a_token(tiny_llama):
    """A more urgent request's decode takes its blocks mid-prefill (recompute): its prompt
    is computed again, and each position's logprob is kept once."""
    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=9, block_size=16,
                    max_num_batched_tokens=8, max_num_seqs=4, preemption_mode="recompute")
    engine.add_request(prompt(40, seed=5), SamplingParams(max_tokens=80, temperature=0,
                                                          ignore_eos=True), priority=-1)
    ids = prompt(100)
    rid = engine.add_request(ids, SamplingParams(max_tokens=2, temperature=0,
                                                 prompt_logprobs=1))
    done = {}
    preempted_in_prefill = False
    while engine.has_unfinished():
        for out in engine.step():
            if out.completion is not None:
                done[out.request_id] = out.completion
        req = engine.scheduler.requests.get(rid)
        if req is not None and req.num_preemptions and not req.output_token_ids:
            preempted_in_prefill = True
    assert preempted_in_prefill  # precondition: preempted before its first token
    check(tiny_llama, done[rid], ids, 1)


def test_bad_values_and_a_simulated_engine_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="prompt_logprobs must be <= 20"):
        SamplingParams(prompt_logprobs=21)
    assert "prompt_logprobs" not in SamplingParams().to_dict()
    engine = Engine(tiny_llama, simulate_step_ms=0.0)
    with pytest.raises(ValueError, match="simulated"):
        engine.add_request([1, 2, 3], SamplingParams(prompt_logprobs=1))


def test_prompt_logprobs_that_would_not_fit_an_entry_or_kv_from_elsewhere_are_refused(
        tiny_llama):
    from producer.wire.protocol import MAX_ENTRY_BYTES
    from worker.engine.admission import AdmissionChecks

    AdmissionChecks.check_prompt_logprobs(10_000, 20, preloaded=False)  # ~3 MB: fits
    with pytest.raises(ValueError, match="would not fit in one output entry: at most"):
        AdmissionChecks.check_prompt_logprobs(14_000, 20, preloaded=False)
    assert 14_000 * (20 + 20 * 15) > MAX_ENTRY_BYTES - 2**18
    with pytest.raises(ValueError, match="comes from another engine"):
        AdmissionChecks.check_prompt_logprobs(10, 0, preloaded=True)


@pytest.mark.parametrize("k", [0, 1, 20])
def test_the_size_bound_holds_for_the_largest_values(k):
    """A first chunk's prompt logprobs at their largest (32-bit ids, float64 logprobs) take
    at most PROMPT_LOGPROB_BYTES + k x PROMPT_ALTERNATIVE_BYTES a prompt token."""
    from producer.wire.protocol import (
        PROMPT_ALTERNATIVE_BYTES,
        PROMPT_LOGPROB_BYTES,
        OutputChunk,
    )

    n, big, lp = 1000, 2**31 - 1, -1.2345678901234567
    bare = OutputChunk(0, [big], "x")
    full = OutputChunk(0, [big], "x", None, [big] * n,
                       [None] + [[lp, [[big, lp]] * k] for _ in range(n - 1)])
    assert len(full.encode()) - len(bare.encode()) <= n * (
        PROMPT_LOGPROB_BYTES + k * PROMPT_ALTERNATIVE_BYTES)
