"""Completions' ``echo`` through the gateway and a real worker: the prompt first in the
answer, its tokens' logprobs (null for the first) before the answer's, equal to
transformers' float64 ``log_softmax`` within 1e-6 on a float64 worker, through a chunked
prefill and after the prompt's prefix was cached; streamed and not; as lm-eval asks for a
loglikelihood (token ids, ``max_tokens: 1``, ``logprobs: 1``, ``echo: true``)."""

from __future__ import annotations

import openai
import pytest
import torch
from fleet_fixtures import MODEL
from hf_reference import _load

from producer.client.client import Client

TOLERANCE = 1e-6


@pytest.fixture
def oai(gateway):
    with openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0) as client:
        yield client


@torch.inference_mode()
def reference(model_dir, ids: list[int]) -> list[float]:
    logits = _load(str(model_dir))(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()


def answer(oai, stream: bool, **body):
    """(text, the four logprob lists joined, finish reason) of one completion."""
    done = oai.completions.create(model=MODEL, stream=stream, **body)
    chunks = list(done) if stream else [done]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    lists = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            for name in lists:
                lists[name] += getattr(c.choices[0].logprobs, name)
    reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return text, lists, reason


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_equals_transformers_float64(start_worker, oai, redis_url,
                                                        tiny_llama, stream):
    # A budget of 32 tokens a step: the 90-token prompt is computed in chunks.
    start_worker(max_num_batched_tokens=32, block_size=16)
    ids = [(7 * i + 3) % 400 + 2 for i in range(90)]
    with Client(redis_url) as client:  # the prefix cached first
        plain = client.result(client.submit(ids, model=MODEL, max_tokens=1, temperature=0),
                              timeout=60)
        again = client.result(client.submit(ids, model=MODEL, max_tokens=1, temperature=0),
                              timeout=60)
    assert again.usage.cached_tokens >= 80  # precondition: a prefix-cache hit was there
    text, lp, reason = answer(oai, stream, prompt=ids, max_tokens=1, temperature=0,
                              logprobs=1, echo=True)
    assert reason == "length" and len(lp["token_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = reference(tiny_llama, ids)
    got = lp["token_logprobs"][1:len(ids)]
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < TOLERANCE
    assert all(len(top) >= 1 for top in lp["top_logprobs"][1:])
    assert text.endswith(plain.text) and lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_first_with_or_without_logprobs(start_worker, oai, stream):
    start_worker()
    prompt = "The river ran past the old stone bridge"
    free, _, _ = answer(oai, stream, prompt=prompt, max_tokens=6, temperature=0)
    echoed, lp, _ = answer(oai, stream, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert echoed == prompt + free and lp["tokens"] == []
    with_lp, lp, _ = answer(oai, stream, prompt=prompt, max_tokens=6, temperature=0,
                            echo=True, logprobs=2)
    assert with_lp == echoed
    assert len(lp["tokens"]) > 6 and lp["token_logprobs"][0] is None
    with pytest.raises(openai.BadRequestError, match="echo"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    extra_body={"echo": True})
