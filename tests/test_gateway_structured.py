"""Structured outputs through the gateway (the openai SDK, a real worker, random weights:
the grammar does the work): ``chat.completions.parse`` with a Pydantic model and raw
``json_schema``, streamed and not; every answer validates and ends ``stop``."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
from fleet_fixtures import MODEL

MESSAGES = [{"role": "user", "content": "Describe a pet."}]


class Owner(pydantic.BaseModel):
    first: str = pydantic.Field(max_length=8)
    age: int | None = pydantic.Field(default=None, ge=0, le=120)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    kind: Literal["cat", "dog", "fish"]
    tags: list[str] = pydantic.Field(max_length=3)
    owner: Owner


@pytest.fixture
def oai(gateway):
    with openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0) as client:
        yield client


def test_parse_with_a_pydantic_model_and_raw_json_schema(start_worker, oai):
    start_worker()
    for seed in range(4):
        done = oai.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pet,
                                          max_tokens=512, temperature=1.0, seed=seed)
        assert done.choices[0].finish_reason == "stop"
        assert isinstance(done.choices[0].message.parsed, Pet)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    form = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema,
                                                   "strict": True}}
    text = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=form, max_tokens=64,
        temperature=1.0, seed=7, stream=True) if c.choices)
    jsonschema.validate(json.loads(text), schema)
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                    response_format={"type": "regex", "regex": "(("})
    assert refused.value.body["param"] == "response_format"
