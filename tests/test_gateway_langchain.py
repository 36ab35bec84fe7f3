"""langchain-openai's ChatOpenAI against the gateway and a real worker, as its users call it:
invoke (content given as a list of text parts), stream, batch, and n choices; each answer
equal to the same request through conveyor's own client."""

from __future__ import annotations

import pytest
from fleet_fixtures import MODEL

from producer.client.client import Client

langchain_openai = pytest.importorskip("langchain_openai")
messages_module = pytest.importorskip("langchain_core.messages")

QUESTION = "Where does the river run?"


@pytest.fixture
def chat(gateway):
    return langchain_openai.ChatOpenAI(base_url=gateway.api, api_key="unused", model=MODEL,
                                       max_tokens=8, temperature=0, max_retries=0)


def test_invoke_stream_batch_and_n_choices(start_worker, chat, redis_url):
    start_worker()
    with Client(redis_url) as client:
        want = client.result(client.submit(
            messages=[{"role": "user", "content": QUESTION}], model=MODEL, max_tokens=8,
            temperature=0), timeout=60)
    parts = messages_module.HumanMessage(content=[{"type": "text", "text": QUESTION}])
    assert chat.invoke([parts]).content == want.text
    assert "".join(chunk.content for chunk in chat.stream(QUESTION)) == want.text
    assert [m.content for m in chat.batch([QUESTION, QUESTION])] == [want.text] * 2
    sampled = chat.bind(temperature=1.0, seed=3, n=2)
    result = sampled.invoke(QUESTION)  # (a chat model answers with its first choice)
    with Client(redis_url) as client:
        first = client.result(client.submit(
            messages=[{"role": "user", "content": QUESTION}], model=MODEL, max_tokens=8,
            temperature=1.0, seed=3), timeout=60)
    assert result.content == first.text
    generations = chat.generate([[parts]], n=2, temperature=1.0, seed=3)
    assert len(generations.generations[0]) == 2
    assert generations.generations[0][0].text == first.text
