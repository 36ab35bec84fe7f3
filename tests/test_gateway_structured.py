"""Structured outputs through the gateway (the openai SDK, a real worker, random weights:
the grammar does the work): ``chat.completions.parse`` with a Pydantic model and raw
``json_schema``, streamed and not; every answer validates and ends ``stop``."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import jsonschema
import openai
import pydantic
import pytest
from fleet_fixtures import MODEL
from structured_schemas import SCHEMAS

MESSAGES = [{"role": "user", "content": "Describe a pet."}]


class Owner(pydantic.BaseModel):
    first: str = pydantic.Field(max_length=8)
    age: int | None = pydantic.Field(default=None, ge=0, le=120)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    kind: Literal["cat", "dog", "fish"]
    tags: list[Annotated[str, pydantic.StringConstraints(pattern=r"^[a-z]{1,5}$")]] = \
        pydantic.Field(max_length=3)
    owner: Owner


@pytest.fixture
def oai(gateway):
    with openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0) as client:
        yield client


# Nesting, maxItems, maxLength and pattern, enum, anyOf, $ref and optional fields.
NESTED = SCHEMAS["nested"]


def test_a_hundred_answers_parse_and_validate(start_worker, oai):
    """50 through the SDK's parse with a Pydantic model, 50 with a raw json_schema, eight
    at a time, max_tokens 512: every answer validates and ends stop."""
    from concurrent.futures import ThreadPoolExecutor

    start_worker()
    form = {"type": "json_schema", "json_schema": {"name": "pet", "schema": NESTED,
                                                   "strict": True}}

    def parsed(seed: int) -> None:
        done = oai.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pet,
                                          max_tokens=512, temperature=1.0, seed=seed)
        assert done.choices[0].finish_reason == "stop"
        assert isinstance(done.choices[0].message.parsed, Pet)

    def raw(seed: int) -> None:
        done = oai.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=form,
                                           max_tokens=512, temperature=1.0, seed=seed)
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].message.content), NESTED)

    with ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(parsed, i) for i in range(50)] + [
                pool.submit(raw, 100 + i) for i in range(50)]:
            future.result()


def test_streamed_json_schema_and_refusals(start_worker, oai):
    start_worker()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    form = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema,
                                                   "strict": True}}
    text = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=form, max_tokens=64,
        temperature=1.0, seed=7, stream=True) if c.choices)
    jsonschema.validate(json.loads(text), schema)
    for bad in ({"type": "regex", "regex": "(("}, {"type": "json_schema"}):
        with pytest.raises(openai.BadRequestError) as refused:
            oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                        response_format=bad)
        assert refused.value.body["param"] == "response_format"


def test_langchain_structured_output_in_json_schema_and_json_modes(start_worker, gateway):
    """langchain-openai's with_structured_output in its json_schema mode: a Pydantic model
    back. In its json_mode (any JSON object, which a random model need not close within
    max_tokens: about half its objects close within 2,048 tokens here), a parsed object
    from the first of a few seeds whose answer closes, and a length error before it
    (function_calling: tests/test_gateway_tools.py)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    start_worker()
    chat = langchain_openai.ChatOpenAI(base_url=gateway.api, api_key="unused", model=MODEL,
                                       max_tokens=256, temperature=1.0, seed=3, max_retries=0)
    pet = chat.with_structured_output(Pet, method="json_schema").invoke("Describe a pet.")
    assert isinstance(pet, Pet)
    schema = {"title": "Anything", "type": "object"}
    for seed in range(8):
        chat = langchain_openai.ChatOpenAI(base_url=gateway.api, api_key="unused", model=MODEL,
                                           max_tokens=2048, temperature=1.0, seed=seed,
                                           max_retries=0)
        try:
            parsed = chat.with_structured_output(schema, method="json_mode").invoke(
                "Describe a pet, in JSON.")
        except openai.LengthFinishReasonError:
            continue  # (its object was still open at max_tokens)
        assert isinstance(parsed, dict)
        break
    else:
        pytest.fail("no json_mode answer closed its object in 8 seeds")
