"""docs/schema/*.schema.json describe the wire as the code speaks it.

The request schema names exactly the fields the code reads, with the code's limits and
defaults; every request the producer writes validates; a malformed map the worker refuses
is refused by the schema too, except the few things JSON Schema cannot say (listed below,
and in docs/protocol.md). Output chunks and final entries as workers encode them validate.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator, ValidationError, validators

from producer.client.client import build_request
from producer.wire import messages as wire_messages
from producer.wire import params as wire_params
from producer.wire import protocol, response_format
from producer.wire.completion import FinishReason, Usage
from producer.wire.keys import LANES, validate_name
from producer.wire.params import SamplingParams
from producer.wire.protocol import (
    REQUEST_FIELDS,
    FinalEntry,
    GenerationRequest,
    OutputChunk,
    ProtocolError,
    decode_output,
    error_final,
)
from producer.wire.tools import spec as tool_spec
from producer.wire.validation import MAX_TOKEN_ID, REQUEST_ID_PATTERN


def ecma_pattern(validator, pattern, instance, schema):
    """``pattern`` as JSON Schema means it (ECMA-262): ``$`` is the end of the string.
    Python's ``$`` also matches before a final newline, which would let ``"tiny\n"`` pass."""
    if not validator.is_type(instance, "string"):
        return
    found = re.search(pattern, instance)
    if found is None or (pattern.endswith("$") and found.end() != len(instance)):
        yield ValidationError(f"{instance[:40]!r} does not match {pattern!r}")


Validator = validators.extend(Draft202012Validator, {"pattern": ecma_pattern})
DOCS = Path(__file__).resolve().parents[1] / "docs"
SCHEMA_DIR = DOCS / "schema"
REQUEST_SCHEMA = json.loads((SCHEMA_DIR / "request.schema.json").read_text())
OUTPUT_SCHEMA = json.loads((SCHEMA_DIR / "output.schema.json").read_text())
REQUEST = Validator(REQUEST_SCHEMA)
OUTPUT = Validator(OUTPUT_SCHEMA)
PARAMS = REQUEST_SCHEMA["$defs"]["params"]["properties"]

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def at(schema: dict[str, Any], pointer: str) -> Any:
    """The value at a JSON pointer (RFC 6901) in ``schema``."""
    node: Any = schema
    for part in pointer.lstrip("/").split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def wire(message: bytes) -> dict[str, Any]:
    """A message as a reader in any language sees it: msgpack decoded to plain values."""
    return msgpack.unpackb(message, raw=False)


def schema_errors(validator: Any, instance: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}"
            for e in validator.iter_errors(instance)]


def documented_names(heading: str) -> set[str]:
    """The names in the first column of the table under ``heading`` in docs/protocol.md."""
    lines = (DOCS / "protocol.md").read_text().splitlines()
    start = lines.index(heading) + 1
    names: set[str] = set()
    for line in lines[start:]:
        if line.startswith("#"):
            break
        if line.startswith("| `"):
            names.update(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    return names


def code_refuses(m: dict[str, Any]) -> bool:
    try:
        GenerationRequest.decode(msgpack.packb(m, use_bin_type=True))
    except ProtocolError:
        return True
    return False


# -- the schemas name what the code names -------------------------------------------------

def test_schemas_are_draft_2020_12():
    for schema in (REQUEST_SCHEMA, OUTPUT_SCHEMA):
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        Draft202012Validator.check_schema(schema)


def test_request_properties_are_the_fields_a_worker_reads():
    assert set(REQUEST_SCHEMA["properties"]) == REQUEST_FIELDS
    assert REQUEST_SCHEMA["additionalProperties"] is False


def test_params_properties_are_the_sampling_params_fields():
    assert set(PARAMS) == {f.name for f in fields(SamplingParams)}
    assert REQUEST_SCHEMA["$defs"]["params"]["additionalProperties"] is False


def test_params_defaults_are_sampling_params_defaults():
    # (to_dict leaves out the later fields at their defaults: an older worker takes it)
    written = SamplingParams().to_dict()
    assert set(written) == set(PARAMS) - set(wire_params.LATER_FIELDS)
    assert {name: spec["default"] for name, spec in PARAMS.items()} \
        == {**written, **wire_params.LATER_FIELDS}
    assert {name: getattr(SamplingParams(), name) for name in wire_params.LATER_FIELDS} \
        == wire_params.LATER_FIELDS


def test_request_defaults_are_what_a_worker_assumes_for_a_missing_field():
    minimal = {"v": 1, "id": "r1", "model": "m", "prompt": "hi"}
    assert REQUEST.is_valid(minimal)
    got = GenerationRequest.decode(msgpack.packb(minimal))
    props = REQUEST_SCHEMA["properties"]
    assert got.priority == props["priority"]["default"]
    assert got.lane == props["lane"]["default"]
    assert got.created_ms == props["created_ms"]["default"]
    assert got.deadline_ms == props["deadline_ms"]["default"]
    assert got.params == SamplingParams.from_dict(props["params"]["default"])
    assert sorted(REQUEST_SCHEMA["required"]) == ["id", "model", "v"]


def test_enums_and_constants_are_the_code_ones():
    assert at(REQUEST_SCHEMA, "/properties/v/const") == protocol.SCHEMA_VERSION
    assert tuple(at(REQUEST_SCHEMA, "/properties/lane/enum")) == LANES
    assert (tuple(at(REQUEST_SCHEMA, "/$defs/message/properties/role/enum"))
            == wire_messages.ROLES)
    assert set(at(REQUEST_SCHEMA, "/$defs/message/properties")) == {
        "role", "content", "name", *set().union(*wire_messages.ROLE_FIELDS.values())}
    for name in ("tool", "tool_call"):
        assert at(REQUEST_SCHEMA, f"/$defs/{name}/properties/function/properties/name/pattern") \
            == f"^{tool_spec.NAME_PATTERN.pattern}$"
    assert at(REQUEST_SCHEMA, "/$defs/message/properties/name/maxLength") \
        == wire_messages.MAX_NAME_CHARS
    kwargs = at(REQUEST_SCHEMA, "/properties/chat_template_kwargs")
    assert set(kwargs["propertyNames"]["not"]["enum"]) == wire_messages.RESERVED_TEMPLATE_NAMES
    assert kwargs["x-max-json-chars"] == wire_messages.MAX_TEMPLATE_KWARGS_CHARS
    final = OUTPUT_SCHEMA["$defs"]["final"]["properties"]
    assert final["finish_reason"]["enum"] == [str(r) for r in FinishReason]
    assert set(OUTPUT_SCHEMA["$defs"]["usage"]["properties"]) == {f.name for f in fields(Usage)}
    for kind, cls in (("chunk", OutputChunk), ("final", FinalEntry)):
        properties = OUTPUT_SCHEMA["$defs"][kind]["properties"]
        assert set(properties) == {"v", "kind"} | {f.name for f in fields(cls)
                                                   if f.metadata.get("on_wire", True)}
        assert properties["v"]["const"] == protocol.SCHEMA_VERSION


def test_protocol_md_documents_every_field():
    assert documented_names("### The request message") == REQUEST_FIELDS
    assert documented_names("### Sampling parameters (`params`)") == set(PARAMS)
    assert documented_names("## Output (`{ns}:out:{id}`)") == set(
        OUTPUT_SCHEMA["$defs"]["usage"]["properties"])


P = "/$defs/params/properties"
LIMITS = [
    ("/x-max-entry-bytes", protocol.MAX_ENTRY_BYTES),
    ("/properties/prompt/maxLength", protocol.MAX_PROMPT_CHARS),
    ("/properties/prompt_token_ids/maxItems", protocol.MAX_PROMPT_TOKENS),
    ("/properties/messages/maxItems", wire_messages.MAX_MESSAGES),
    ("/properties/messages/x-max-total-content-chars", wire_messages.MAX_MESSAGES_CHARS),
    ("/properties/priority/minimum", protocol.PRIORITY_RANGE[0]),
    ("/properties/priority/maximum", protocol.PRIORITY_RANGE[1]),
    ("/properties/created_ms/maximum", protocol.MAX_UNIX_MS),
    ("/properties/deadline_ms/maximum", protocol.MAX_UNIX_MS),
    ("/$defs/token_id/maximum", MAX_TOKEN_ID),
    (f"{P}/max_tokens/maximum", wire_params.MAX_NEW_TOKENS),
    (f"{P}/min_tokens/maximum", wire_params.MAX_NEW_TOKENS),
    (f"{P}/top_k/maximum", wire_params.MAX_TOP_K),
    (f"{P}/seed/maximum", wire_params.MAX_SEED),
    (f"{P}/stop/anyOf/1/maxItems", wire_params.MAX_STOP_STRINGS),
    ("/$defs/stop_string/maxLength", wire_params.MAX_STOP_STRING_CHARS),
    (f"{P}/stop_token_ids/maxItems", wire_params.MAX_STOP_TOKEN_IDS),
    (f"{P}/logprobs/maximum", wire_params.MAX_LOGPROBS),
    (f"{P}/prompt_logprobs/maximum", wire_params.MAX_LOGPROBS),
    (f"{P}/n/maximum", wire_params.MAX_CHOICES),
    (f"{P}/response_format/properties/regex/maxLength", response_format.MAX_REGEX_CHARS),
    (f"{P}/response_format/properties/grammar/maxLength", response_format.MAX_GRAMMAR_CHARS),
    ("/properties/tools/maxItems", tool_spec.MAX_TOOLS),
    ("/properties/tools/x-max-json-chars", tool_spec.MAX_TOOLS_CHARS),
    ("/$defs/message/properties/tool_calls/maxItems", tool_spec.MAX_TOOL_CALLS),
    ("/$defs/message/properties/tool_call_id/maxLength", tool_spec.MAX_CALL_ID_CHARS),
    ("/$defs/tool/properties/function/properties/description/maxLength",
     tool_spec.MAX_DESCRIPTION_CHARS),
    (f"{P}/response_format/properties/choices/maxItems", response_format.MAX_CHOICES),
    (f"{P}/response_format/properties/choices/items/maxLength",
     response_format.MAX_CHOICE_CHARS),
    (f"{P}/presence_penalty/minimum", -wire_params.MAX_ABS_PENALTY),
    (f"{P}/presence_penalty/maximum", wire_params.MAX_ABS_PENALTY),
    (f"{P}/frequency_penalty/minimum", -wire_params.MAX_ABS_PENALTY),
    (f"{P}/frequency_penalty/maximum", wire_params.MAX_ABS_PENALTY),
    (f"{P}/repetition_penalty/maximum", wire_params.MAX_REPETITION_PENALTY),
    (f"{P}/logit_bias/maxProperties", wire_params.MAX_LOGIT_BIAS_ENTRIES),
    (f"{P}/logit_bias/additionalProperties/minimum", -wire_params.MAX_ABS_LOGIT_BIAS),
    (f"{P}/logit_bias/additionalProperties/maximum", wire_params.MAX_ABS_LOGIT_BIAS),
]


@pytest.mark.parametrize(("pointer", "expected"), LIMITS, ids=[p for p, _ in LIMITS])
def test_schema_limits_are_the_code_constants(pointer, expected):
    assert at(REQUEST_SCHEMA, pointer) == expected


def test_output_limits_are_the_code_constants():
    logprobs = "/$defs/chunk/properties/logprobs/items/prefixItems/1/maxItems"
    assert at(OUTPUT_SCHEMA, logprobs) == wire_params.MAX_LOGPROBS
    prompt = "/$defs/chunk/properties/prompt_logprobs/items/anyOf/1/prefixItems/1/maxItems"
    assert at(OUTPUT_SCHEMA, prompt) == wire_params.MAX_LOGPROBS


def test_request_id_pattern_is_the_code_pattern():
    assert at(REQUEST_SCHEMA, "/properties/id/pattern") == f"^{REQUEST_ID_PATTERN.pattern}$"


@pytest.mark.parametrize("name", ["a", "tiny", "Qwen2.5-0.5B_x", "a" * 128, "", "a" * 129,
                                  "a b", "a:b", "{a}", "é", "a\n"])
def test_model_name_pattern_agrees_with_validate_name(name):
    try:
        validate_name("model", name)
        accepted = True
    except ValueError:
        accepted = False
    assert REQUEST.is_valid({"v": 1, "id": "r", "model": name, "prompt": "x"}) is accepted


def bias_key_valid(key: str) -> bool:
    return REQUEST.is_valid({"v": 1, "id": "r", "model": "m", "prompt": "x",
                             "params": {"logit_bias": {key: 1.0}}})


@given(st.integers(0, 10 * MAX_TOKEN_ID))
@FUZZ
def test_logit_bias_keys_are_exactly_the_token_ids(token):
    assert bias_key_valid(str(token)) is (token <= MAX_TOKEN_ID)


def test_logit_bias_key_boundaries():
    for token in (0, 9, 10, 999_999_999, 1_000_000_000, MAX_TOKEN_ID):
        assert bias_key_valid(str(token)), token
    for key in (str(MAX_TOKEN_ID + 1), "9999999999", "99999999999", "-1", "", "1.0", " 1",
                "1\n"):
        assert not bias_key_valid(key), key


# -- every request the producer writes validates ------------------------------------------

TOKEN = st.integers(0, MAX_TOKEN_ID)
NUMBER = st.floats(allow_nan=False, allow_infinity=False)
SAMPLING = st.fixed_dictionaries({}, optional={
    "max_tokens": st.none() | st.integers(1, wire_params.MAX_NEW_TOKENS),
    "temperature": st.floats(0, 1e6) | st.integers(0, 100) | st.just(1e-320),
    "top_k": st.integers(0, wire_params.MAX_TOP_K),
    "top_p": st.floats(0, 1, exclude_min=True),
    "min_p": st.floats(0, 1) | st.integers(0, 1),
    "seed": st.none() | st.integers(0, wire_params.MAX_SEED),
    "stop": st.lists(st.text(min_size=1, max_size=wire_params.MAX_STOP_STRING_CHARS),
                     max_size=wire_params.MAX_STOP_STRINGS) | st.text(min_size=1, max_size=8),
    "stop_token_ids": st.lists(TOKEN, max_size=wire_params.MAX_STOP_TOKEN_IDS),
    "ignore_eos": st.booleans(),
    "logprobs": st.none() | st.integers(0, wire_params.MAX_LOGPROBS),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2) | st.integers(-2, 2),
    "repetition_penalty": st.floats(0, wire_params.MAX_REPETITION_PENALTY, exclude_min=True),
    # Keys as ints or as decimal strings (JSON's), each token once.
    "logit_bias": st.dictionaries(TOKEN, st.floats(-100, 100), max_size=16).map(
        lambda bias: {str(t) if t % 2 else t: b for t, b in bias.items()}),
})
PROMPT = st.text(min_size=1, max_size=200) | st.lists(TOKEN, min_size=1, max_size=64)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(wire_messages.ROLES[:-1]),
                                           "content": st.text(max_size=80)})
                    | st.fixed_dictionaries({"role": st.just("tool"),
                                             "content": st.text(max_size=80),
                                             "tool_call_id": st.text(min_size=1, max_size=9)})
                    | st.fixed_dictionaries({
                        "role": st.just("assistant"), "content": st.none() | st.text(max_size=9),
                        "tool_calls": st.lists(st.fixed_dictionaries({
                            "id": st.text(max_size=9), "type": st.just("function"),
                            "function": st.fixed_dictionaries({
                                "name": st.from_regex(tool_spec.NAME_PATTERN, fullmatch=True),
                                "arguments": st.just('{"a": [1, "b"]}') | st.just({})})}),
                            min_size=1, max_size=3)}),
                    min_size=1, max_size=6)
TIMING = st.one_of(
    st.fixed_dictionaries({"deadline_ms": st.none() | st.integers(0, protocol.MAX_UNIX_MS),
                           "timeout": st.none()}),
    st.fixed_dictionaries({"deadline_ms": st.none(),
                           "timeout": st.floats(0.001, 1e6)}),
)


@given(prompt=PROMPT, sampling=SAMPLING, timing=TIMING,
       priority=st.integers(*protocol.PRIORITY_RANGE), lane=st.sampled_from(LANES),
       request_id=st.none() | st.from_regex(REQUEST_ID_PATTERN, fullmatch=True))
@FUZZ
def test_every_request_build_request_writes_validates(prompt, sampling, timing, priority, lane,
                                                      request_id):
    built = build_request(prompt, model="tiny", lane=lane, request_id=request_id,
                          priority=priority, sampling=sampling, **timing)
    assert schema_errors(REQUEST, wire(built.encode())) == []


@given(messages=MESSAGES, sampling=SAMPLING)
@FUZZ
def test_every_chat_request_validates(messages, sampling):
    built = build_request(None, messages=messages, model="tiny", lane="interactive",
                          request_id=None, priority=0, deadline_ms=None, timeout=None,
                          sampling=sampling)
    assert schema_errors(REQUEST, wire(built.encode())) == []


# What a client in another language may write: optional fields left out, nil for defaults.
FOREIGN = [
    {"v": 1, "id": "a", "model": "tiny", "prompt": "Hello"},
    {"v": 1, "id": "a", "model": "tiny", "prompt_token_ids": [1, 2, 3], "params": None},
    {"v": 1, "id": "a", "model": "tiny", "messages": [{"role": "user", "content": ""}]},
    {"v": 1, "id": "a", "model": "tiny", "messages": [{"role": "user", "content": "x",
                                                        "name": "bob"}],
     "chat_template_kwargs": {"enable_thinking": False, "depth": [1, {"a": None}]}},
    {"v": 1, "id": "a", "model": "tiny",
     "messages": [{"role": "user", "content": "x"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"function": {"name": "f", "arguments": "{\"q\": 1}"}}]},
                  {"role": "tool", "content": "2", "tool_call_id": "c"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {
         "type": "object"}}}]},
    {"v": 1, "id": "a", "model": "tiny", "prompt": "x", "prompt_token_ids": None,
     "messages": None, "deadline_ms": None, "lane": "batch", "priority": -1000},
    {"v": 1, "id": "a", "model": "tiny", "prompt": "x",
     "params": {"max_tokens": None, "temperature": 0, "stop": "\n", "seed": None,
                "logit_bias": {"0": -100, "2147483647": 100}, "top_p": 1, "logprobs": 0}},
]


@pytest.mark.parametrize("m", FOREIGN)
def test_requests_with_defaults_left_out_are_valid_for_both(m):
    assert schema_errors(REQUEST, m) == []
    assert not code_refuses(m)


# -- what the worker refuses, the schema refuses ------------------------------------------

BASE = {"v": 1, "id": "req-1", "model": "tiny", "prompt": "Hello", "params": {},
        "priority": 0, "lane": "interactive", "created_ms": 1, "deadline_ms": None}
DELETE = object()


def changed(**fields_: Any) -> dict[str, Any]:
    m = {**BASE, **fields_}
    return {k: v for k, v in m.items() if v is not DELETE}


def with_params(**params: Any) -> dict[str, Any]:
    return changed(params=params)


def user(content: Any = "hi", **extra: Any) -> dict[str, Any]:
    return {"role": "user", "content": content, **extra}


BIG = 2**31
INVALID = {
    "v 2": changed(v=2),
    "v missing": changed(v=DELETE),
    "v as a string": changed(v="1"),
    "unknown field": changed(extra=1),
    "id missing": changed(id=DELETE),
    "id empty": changed(id=""),
    "id too long": changed(id="a" * 65),
    "id with a colon": changed(id="a:b"),
    "id with a final newline": changed(id="a\n"),
    "id an int": changed(id=5),
    "model missing": changed(model=DELETE),
    "model with braces": changed(model="{tiny}"),
    "model too long": changed(model="m" * 129),
    "no prompt at all": changed(prompt=DELETE),
    "prompt nil": changed(prompt=None),
    "prompt and token ids": changed(prompt_token_ids=[1]),
    "prompt and messages": changed(messages=[user()]),
    "all three": changed(prompt_token_ids=[1], messages=[user()]),
    "prompt empty": changed(prompt=""),
    "prompt too long": changed(prompt="x" * (protocol.MAX_PROMPT_CHARS + 1)),
    "prompt an int": changed(prompt=5),
    "prompt a list of strings": changed(prompt=["a"]),
    "token ids empty": changed(prompt=DELETE, prompt_token_ids=[]),
    "token id negative": changed(prompt=DELETE, prompt_token_ids=[-1]),
    "token id too large": changed(prompt=DELETE, prompt_token_ids=[BIG]),
    "token id a string": changed(prompt=DELETE, prompt_token_ids=["1"]),
    "token id a bool": changed(prompt=DELETE, prompt_token_ids=[True]),
    "token id a float": changed(prompt=DELETE, prompt_token_ids=[1.5]),
    "too many token ids": changed(prompt=DELETE,
                                  prompt_token_ids=[1] * (protocol.MAX_PROMPT_TOKENS + 1)),
    "messages empty": changed(prompt=DELETE, messages=[]),
    "messages a map": changed(prompt=DELETE, messages=user()),
    "message a string": changed(prompt=DELETE, messages=["hi"]),
    "message role tool": changed(prompt=DELETE, messages=[{"role": "tool", "content": "x"}]),
    "message without content": changed(prompt=DELETE, messages=[{"role": "user"}]),
    "message without role": changed(prompt=DELETE, messages=[{"content": "x"}]),
    "message array content": changed(prompt=DELETE,
                                     messages=[user([{"type": "text", "text": "hi"}])]),
    "message nil content": changed(prompt=DELETE, messages=[user(None)]),
    "message with an empty name": changed(prompt=DELETE, messages=[user(name="")]),
    "template kwargs without messages": changed(chat_template_kwargs={"a": 1}),
    "template kwargs a list": changed(prompt=DELETE, messages=[user()],
                                      chat_template_kwargs=[1]),
    "template kwargs set messages": changed(prompt=DELETE, messages=[user()],
                                            chat_template_kwargs={"messages": []}),
    "template kwargs set bos_token": changed(prompt=DELETE, messages=[user()],
                                             chat_template_kwargs={"bos_token": "x"}),
    "template kwargs name not an identifier": changed(prompt=DELETE, messages=[user()],
                                                      chat_template_kwargs={"a-b": 1}),
    "message with a tool call": changed(prompt=DELETE, messages=[user(tool_calls=[])]),
    "too many messages": changed(prompt=DELETE,
                                 messages=[user()] * (wire_messages.MAX_MESSAGES + 1)),
    "params a string": changed(params="greedy"),
    "params a list": changed(params=[]),
    "unknown param": with_params(temp=0),
    "max_tokens 0": with_params(max_tokens=0),
    "max_tokens too large": with_params(max_tokens=BIG),
    "max_tokens a bool": with_params(max_tokens=True),
    "max_tokens 1.5": with_params(max_tokens=1.5),
    "temperature negative": with_params(temperature=-0.1),
    "temperature a string": with_params(temperature="0"),
    "temperature nil": with_params(temperature=None),
    "top_k negative": with_params(top_k=-1),
    "top_k too large": with_params(top_k=BIG),
    "top_p 0": with_params(top_p=0),
    "top_p above 1": with_params(top_p=1.01),
    "min_p negative": with_params(min_p=-0.1),
    "min_p above 1": with_params(min_p=1.1),
    "seed negative": with_params(seed=-1),
    "seed too large": with_params(seed=2**63),
    "too many stop strings": with_params(stop=["s"] * (wire_params.MAX_STOP_STRINGS + 1)),
    "empty stop string": with_params(stop=[""]),
    "empty stop string alone": with_params(stop=""),
    "stop string too long": with_params(stop=["s" * (wire_params.MAX_STOP_STRING_CHARS + 1)]),
    "stop an int": with_params(stop=[1]),
    "stop nil": with_params(stop=None),
    "too many stop token ids": with_params(
        stop_token_ids=[1] * (wire_params.MAX_STOP_TOKEN_IDS + 1)),
    "stop token id negative": with_params(stop_token_ids=[-1]),
    "stop token ids a map": with_params(stop_token_ids={"1": 1}),
    "ignore_eos 1": with_params(ignore_eos=1),
    "ignore_eos nil": with_params(ignore_eos=None),
    "logprobs too many": with_params(logprobs=wire_params.MAX_LOGPROBS + 1),
    "logprobs negative": with_params(logprobs=-1),
    "presence_penalty above 2": with_params(presence_penalty=2.01),
    "frequency_penalty below -2": with_params(frequency_penalty=-2.01),
    "repetition_penalty 0": with_params(repetition_penalty=0),
    "repetition_penalty above 10": with_params(repetition_penalty=10.01),
    "logit_bias key not a number": with_params(logit_bias={"x": 1}),
    "logit_bias key negative": with_params(logit_bias={"-1": 1}),
    "logit_bias key too large": with_params(logit_bias={str(BIG): 1}),
    "logit_bias value above 100": with_params(logit_bias={"1": 101}),
    "logit_bias value below -100": with_params(logit_bias={"1": -100.5}),
    "logit_bias value a string": with_params(logit_bias={"1": "ban"}),
    "logit_bias nil": with_params(logit_bias=None),
    "too many logit_bias entries": with_params(
        logit_bias={str(i): 1 for i in range(wire_params.MAX_LOGIT_BIAS_ENTRIES + 1)}),
    "priority too high": changed(priority=1001),
    "priority too low": changed(priority=-1001),
    "priority a bool": changed(priority=True),
    "priority nil": changed(priority=None),
    "priority 1.5": changed(priority=1.5),
    "lane unknown": changed(lane="bulk"),
    "lane nil": changed(lane=None),
    "created_ms negative": changed(created_ms=-1),
    "created_ms past year 9999": changed(created_ms=protocol.MAX_UNIX_MS + 1),
    "created_ms nil": changed(created_ms=None),
    "deadline_ms negative": changed(deadline_ms=-1),
    "deadline_ms past year 9999": changed(deadline_ms=protocol.MAX_UNIX_MS + 1),
    "deadline_ms a string": changed(deadline_ms="soon"),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_a_map_the_worker_refuses_the_schema_refuses(name):
    m = INVALID[name]
    assert code_refuses(m), "the code accepts it: not a refusal case"
    assert not REQUEST.is_valid(m)


# Refused by the code, beyond what JSON Schema can say (docs/protocol.md lists them). Kept
# exact: a case the schema comes to refuse moves to INVALID.
BEYOND_THE_SCHEMA = {
    # msgpack tells 1.0 from 1; JSON Schema's "integer" is any number without a fraction.
    "priority 1.0": changed(priority=1.0),
    "max_tokens 16.0": with_params(max_tokens=16.0),
    "token id 3.0": changed(prompt=DELETE, prompt_token_ids=[3.0]),
    # JSON has no NaN or infinity; msgpack floats do.
    "temperature NaN": with_params(temperature=math.nan),
    "temperature infinite": with_params(temperature=math.inf),
    "top_p NaN": with_params(top_p=math.nan),
    # Sizes as JSON and sums over items.
    "template kwargs too long": changed(prompt=DELETE, messages=[user()], chat_template_kwargs={
        "a": "x" * wire_messages.MAX_TEMPLATE_KWARGS_CHARS}),
    "messages too long in all": changed(prompt=DELETE, messages=[
        user("x" * (wire_messages.MAX_MESSAGES_CHARS // 2 + 1))] * 2),
}


@pytest.mark.parametrize("name", list(BEYOND_THE_SCHEMA))
def test_what_only_the_code_refuses(name):
    m = BEYOND_THE_SCHEMA[name]
    assert code_refuses(m)
    assert REQUEST.is_valid(m), "the schema refuses it now: move it to INVALID"


# Accepted by the code, refused by the schema: forms no producer writes, kept out of the
# contract (a client that follows the schema writes only what every reader accepts).
NARROWER_THAN_THE_CODE = {
    "logit_bias as pairs": with_params(logit_bias=[[1, 2.0]]),
    "logit_bias key with leading zeros": with_params(logit_bias={"007": 2.0}),
}


@pytest.mark.parametrize("name", list(NARROWER_THAN_THE_CODE))
def test_what_only_the_schema_refuses(name):
    m = NARROWER_THAN_THE_CODE[name]
    assert not code_refuses(m)
    assert not REQUEST.is_valid(m)


# -- output entries as workers encode them --------------------------------------------------

USAGE_FIELDS = [f.name for f in fields(Usage)]
USAGE = st.dictionaries(st.sampled_from(USAGE_FIELDS), st.integers(0, 2**40))


LOGPROB = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)


@st.composite
def chunks(draw) -> OutputChunk:
    """A chunk as workers write it: with logprobs (one per token) only when asked for."""
    token_ids = draw(st.lists(TOKEN, min_size=1, max_size=32))
    top = st.lists(st.tuples(TOKEN, LOGPROB).map(list), max_size=wire_params.MAX_LOGPROBS)
    logprobs = draw(st.none() | st.lists(st.tuples(LOGPROB, top).map(list),
                                         min_size=len(token_ids), max_size=len(token_ids)))
    chunk = OutputChunk(draw(st.integers(0, 2**40)), token_ids, draw(st.text(max_size=100)),
                        logprobs)
    if draw(st.booleans()):  # a first chunk with its prompt's logprobs
        prompt = draw(st.lists(TOKEN, min_size=1, max_size=32))
        chunk.prompt_token_ids = prompt
        chunk.prompt_logprobs = [None] + draw(st.lists(
            st.tuples(LOGPROB, top).map(list), min_size=len(prompt) - 1,
            max_size=len(prompt) - 1))
    return chunk


@given(chunk=chunks())
@FUZZ
def test_every_chunk_validates(chunk):
    assert schema_errors(OUTPUT, wire(chunk.encode())) == []
    assert decode_output(chunk.encode()) == chunk


@given(reason=st.sampled_from(list(FinishReason)), num_tokens=st.integers(0, 2**40),
       usage=USAGE, error=st.none() | st.text(max_size=100), text=st.text(max_size=100))
@FUZZ
def test_every_final_entry_validates(reason, num_tokens, usage, error, text):
    entry = FinalEntry(str(reason), num_tokens, usage, error, text)
    assert schema_errors(OUTPUT, wire(entry.encode())) == []


def test_error_final_validates():
    assert schema_errors(OUTPUT, wire(error_final("model not served", 3).encode())) == []


CHUNK = wire(OutputChunk(0, [1, 2], "ab").encode())
FINAL = wire(FinalEntry("stop", 2, {"prompt_tokens": 3, "completion_tokens": 2}).encode())
INVALID_OUTPUT = {
    "unknown kind": {**CHUNK, "kind": "delta"},
    "chunk without text": {k: v for k, v in CHUNK.items() if k != "text"},
    "chunk negative index": {**CHUNK, "index": -1},
    "chunk without tokens": {**CHUNK, "token_ids": []},
    "chunk of v 2": {**CHUNK, "v": 2},
    "logprobs without alternatives": {**CHUNK, "logprobs": [[-0.5], [-0.1]]},
    "logprobs alternative named by text": {**CHUNK, "logprobs": [[-0.5, [["a", -0.5]]]]},
    "too many alternatives": {**CHUNK, "logprobs": [[-0.5, [[1, -0.5]] * 21]]},
    "prompt logprob without alternatives": {**CHUNK, "prompt_token_ids": [1, 2],
                                            "prompt_logprobs": [None, [-0.5]]},
    "unknown finish reason": {**FINAL, "finish_reason": "done"},
    "unknown usage field": {**FINAL, "usage": {"tokens": 1}},
    "final without usage": {k: v for k, v in FINAL.items() if k != "usage"},
    "final with token ids": {**FINAL, "token_ids": [1]},
}


@pytest.mark.parametrize("name", list(INVALID_OUTPUT))
def test_malformed_output_entries_are_refused(name):
    assert not OUTPUT.is_valid(INVALID_OUTPUT[name])
