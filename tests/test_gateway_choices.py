"""``n`` choices through the gateway (the openai SDK, a real worker): one request, n
choices with their indexes, each equal to a single request seeded seed + i; streamed, each
chunk carries its choice's index and every choice ends; usage counts the prompt once and
every choice's tokens; ``best_of`` is refused, named."""

from __future__ import annotations

import openai
import pytest
from fleet_fixtures import MODEL

from producer.client.client import Client

PROMPT = "The river ran past the old stone bridge"
MESSAGES = [{"role": "user", "content": "Where does the river run?"}]
SAMPLED = {"max_tokens": 10, "temperature": 0.9, "seed": 11}


@pytest.fixture
def oai(gateway):
    with openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0) as client:
        yield client


def singles(redis_url, **request) -> list:
    """Three single requests seeded 11, 12, 13."""
    with Client(redis_url) as client:
        return [client.result(client.submit(model=MODEL, **{**request, **SAMPLED, "seed": s},
                                            ignore_eos=True), timeout=60)
                for s in (11, 12, 13)]


def test_three_choices_not_streamed(start_worker, oai, redis_url):
    start_worker()
    want = singles(redis_url, prompt=PROMPT)
    done = oai.completions.create(model=MODEL, prompt=PROMPT, n=3, extra_body={
        "ignore_eos": True}, **SAMPLED)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert [c.text for c in done.choices] == [w.text for w in want]
    assert len({c.text for c in done.choices}) == 3
    assert done.usage.completion_tokens == 30
    assert done.usage.prompt_tokens == want[0].usage.prompt_tokens
    chat_want = singles(redis_url, messages=MESSAGES)
    chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, n=3,
                                       extra_body={"ignore_eos": True}, **SAMPLED)
    assert [c.message.content for c in chat.choices] == [w.text for w in chat_want]


def test_three_choices_streamed_each_chunk_with_its_index(start_worker, oai, redis_url):
    start_worker()
    want = singles(redis_url, messages=MESSAGES)
    texts, reasons, usage = ["", "", ""], [None] * 3, None
    for chunk in oai.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True}, **SAMPLED):
        if not chunk.choices:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [w.text for w in want] and reasons == ["length"] * 3
    assert usage.completion_tokens == 30
    streamed = [""] * 2
    for chunk in oai.completions.create(model=MODEL, prompt=PROMPT, n=2, stream=True,
                                        echo=True, logprobs=1,
                                        extra_body={"ignore_eos": True}, **SAMPLED):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert all(t.startswith(PROMPT) for t in streamed)


def test_best_of_is_refused_named(start_worker, oai):
    start_worker()
    with pytest.raises(openai.BadRequestError) as refused:
        oai.completions.create(model=MODEL, prompt=PROMPT, best_of=2, max_tokens=2)
    assert refused.value.body["param"] == "best_of"
