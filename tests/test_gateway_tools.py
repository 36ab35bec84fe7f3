"""Tools through the gateway (a real worker on a made model with a tools template, random
weights: the grammar writes forced calls): the openai SDK and langchain-openai's
``bind_tools`` and ``with_structured_output``, in both tool-call formats (Qwen/Hermes
``<tool_call>`` blocks, Llama 3.1 JSON), streamed deltas joined to the same calls, the
tool-call history accepted, and what cannot be served refused with its reason."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest
from fleet_fixtures import MODEL

langchain_openai = pytest.importorskip("langchain_openai")

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["c", "f"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {
             "name": "add", "parameters": {"type": "object",
                                           "properties": {"a": {"type": "integer",
                                                                "maximum": 99},
                                                          "b": {"type": "integer",
                                                                "maximum": 99}},
                                           "required": ["a", "b"],
                                           "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class Movie(pydantic.BaseModel):
    """A movie."""

    title: str = pydantic.Field(max_length=12)
    year: int = pydantic.Field(ge=1900, le=2030)


@pytest.fixture(params=["qwen", "llama3"])
def tools_worker(request, model_factory, start_worker):
    """A worker whose model's chat template has tools support, in either style."""
    style = request.param
    folder = model_factory(f"tools-{style}", preset="tiny", arch="llama", chat_template=style)
    start_worker(model_dir=folder)
    return style


@pytest.fixture
def oai(gateway):
    with openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0) as client:
        yield client


def chat(gateway, **settings):
    return langchain_openai.ChatOpenAI(base_url=gateway.api, api_key="unused", model=MODEL,
                                       max_retries=0, temperature=1.0, max_tokens=256,
                                       **settings)


def valid_calls(calls, cut: bool = False) -> None:
    """Each call's arguments valid against its function's schema (``cut``: but the last,
    cut by max_tokens)."""
    assert calls
    for call in calls[:-1] if cut else calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_parse_against_their_schemas(tools_worker, oai):
    """One call an answer without parallel calls; with them (Hermes blocks), several in
    some answers, each with its own id. An answer cut at max_tokens keeps its calls, the
    last one's arguments perhaps cut (as OpenAI's)."""
    counts = []
    for seed in range(6):
        for parallel in (False, True):
            done = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                               tool_choice="required", max_tokens=256,
                                               temperature=1.0, seed=seed,
                                               parallel_tool_calls=parallel)
            choice = done.choices[0]
            calls = choice.message.tool_calls
            valid_calls(calls, cut=choice.finish_reason == "length")
            assert len({c.id for c in calls}) == len(calls)
            if parallel:
                counts.append(len(calls))
                assert choice.finish_reason in ("tool_calls", "length")
            else:
                assert len(calls) == 1 and choice.finish_reason == "tool_calls", choice
                assert choice.message.content is None
    # (Llama 3.1's format holds one call a turn, parallel or not.)
    assert max(counts) > 1 if tools_worker == "qwen" else max(counts) == 1


def test_a_named_function_is_the_one_called(tools_worker, oai):
    """Once, with parallel calls allowed (the default) too; what would cut its grammar's
    text, or hold it open, is refused naming the field."""
    named = {"type": "function", "function": {"name": "add"}}
    for seed in range(3):
        done = oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=256, temperature=1.0,
            seed=seed, tool_choice=named)
        [call] = done.choices[0].message.tool_calls
        assert call.function.name == "add"
        valid_calls([call])
    for conflict, param in [({"stop": ["}"]}, "stop"),
                            ({"extra_body": {"min_tokens": 4}}, "min_tokens")]:
        with pytest.raises(openai.BadRequestError) as refused:
            oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                        tool_choice=named, **conflict)
        assert refused.value.param == param and "forced tool call" in refused.value.message


def test_streamed_deltas_join_to_the_calls_of_the_whole_answer(tools_worker, oai):
    """The same request streamed and not: the deltas join, by index, to the whole answer's
    calls (one id and name each, arguments in pieces)."""
    asked = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                 max_tokens=256, temperature=1.0, seed=11)
    whole = oai.chat.completions.create(**asked).choices[0]
    joined: dict[int, dict] = {}
    reasons = []
    for chunk in oai.chat.completions.create(**asked, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = joined.setdefault(delta.index, {"name": "", "arguments": "", "ids": [],
                                                       "pieces": 0})
                if delta.id:
                    call["ids"].append(delta.id)
                if delta.function and delta.function.name:
                    call["name"] += delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
                    call["pieces"] += 1
    assert reasons[-1] == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(joined.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(len(c["ids"]) == 1 for c in joined.values())
    # A Llama answer is read whole: one piece; Hermes calls send their arguments as they
    # come, in as many pieces as chunks brought them (tests/test_tools.py shows each).
    pieces = [c["pieces"] for c in joined.values()]
    assert min(pieces) >= 1 if tools_worker == "qwen" else pieces == [1], pieces


def test_langchain_bind_tools_required_and_structured_output(tools_worker, gateway):
    """bind_tools with tool_choice="required", streamed too; with_structured_output in its
    function_calling and json_schema modes: parsed objects."""
    llm = chat(gateway, seed=5)
    bound = llm.bind_tools([TOOLS[0]["function"] | {"parameters": WEATHER}],
                           tool_choice="required")
    message = bound.invoke(MESSAGES[0]["content"])
    assert message.tool_calls, message
    for call in message.tool_calls:
        jsonschema.validate(call["args"], WEATHER)
    streamed = None
    for piece in bound.stream(MESSAGES[0]["content"]):
        streamed = piece if streamed is None else streamed + piece
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [
        (c["name"], c["args"]) for c in message.tool_calls]
    for method in ("function_calling", "json_schema"):
        # (strict: no properties beyond the model's, which a random model would add forever)
        movie = llm.with_structured_output(Movie, method=method, strict=True).invoke(
            "A film, please.")
        assert isinstance(movie, Movie), method


def test_tool_history_and_tool_choice_none(tools_worker, oai, gateway):
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather",
                                 "arguments": '{"city": "Paris", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    done = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                       tool_choice="none", max_tokens=8, temperature=0)
    choice = done.choices[0]
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "length" and choice.message.content
    # The prompt renders the history: more tokens than the question alone.
    alone = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                        tool_choice="none", max_tokens=1, temperature=0)
    assert done.usage.prompt_tokens > alone.usage.prompt_tokens
    # /tokenize counts what the worker read, tools and history rendered.
    counted = httpx.post(gateway.url + "/tokenize", json={
        "model": MODEL, "messages": history, "tools": TOOLS}, timeout=60).json()
    assert counted["count"] == done.usage.prompt_tokens


def test_what_cannot_be_served_is_refused(start_worker, oai, model_factory):
    start_worker()  # the plain template: no tools support
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
    assert refused.value.code == "tools_not_supported"
    for body, param in [({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tool_choice": "sometimes"}, "tool_choice"),
                        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
                         "tools")]:
        with pytest.raises(openai.BadRequestError) as refused:
            oai.chat.completions.create(model=MODEL, messages=MESSAGES,
                                        **{"tools": TOOLS, **body})
        assert refused.value.param == param, body
