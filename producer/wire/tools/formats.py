"""The tool-call formats models are trained on, chosen by the model's chat template: how a
forced call is written (a grammar for the worker) and how calls are read from an answer.

- ``hermes`` (Hermes, Qwen 2.5 / 3 and most open models): each call a
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` block, several in one
  answer where parallel calls are allowed; text outside the blocks is the answer's content.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 with custom tools): the whole answer is one JSON
  object ``{"name": ..., "parameters": {...}}`` (the template's instruction; its history
  holds one call a turn, so a forced call is one call).

A forced call (``tool_choice`` required or named) is a lark grammar for llguidance with
each function's ``parameters`` as a JSON schema of its own (``%json``): a schema's own
``$ref``s then resolve against itself, and the arguments always parse against it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from producer.wire.tools.scan import CALL, read_header
from producer.wire.tools.spec import NAME_PATTERN, ToolChoice

# A function without parameters takes any object (OpenAI's reading of a missing schema).
ANY_OBJECT = {"type": "object"}
# Compact JSON inside a forced call (see producer/wire/response_format.py: free whitespace
# lets a weak model wander).
COMPACT = {"x-guidance": {"whitespace_flexible": False}}


@dataclass
class ParsedAnswer:
    """An answer's text read as content and calls (``[{"name", "arguments"}]``, arguments
    a JSON text)."""

    content: str | None
    calls: list[dict[str, str]] = field(default_factory=list)


class ToolFormat:
    """One format: its grammar for a forced call, its parser, and where a call may begin
    (for a stream to hold back text that may be one)."""

    name = ""
    # The key the call's arguments go under.
    arguments_key = "arguments"

    def grammar(self, tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool) -> str:
        """The lark grammar of a forced call of ``choice``'s function(s)."""
        raise NotImplementedError

    def parse(self, text: str) -> ParsedAnswer:
        """The answer's content and calls; text that does not parse as calls is content."""
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Where in ``text`` a call begins or may begin; None where none does (a Llama
        answer: a stream holds it from there to its end)."""
        raise NotImplementedError

    def _call_rules(self, tools: list[dict[str, Any]], choice: ToolChoice) -> list[str]:
        """``call_body`` and its rules: one alternative per function that may be called,
        each ``{"name":"<name>","<key>":<its parameters' JSON>}``."""
        functions = [t["function"] for t in tools
                     if choice.mode != "named" or t["function"]["name"] == choice.name]
        names = [f"fn{i}" for i in range(len(functions))]
        rules = ["call_body: " + " | ".join(names)]
        for rule, fn in zip(names, functions, strict=True):
            head = json.dumps(f'{{"name":"{fn["name"]}","{self.arguments_key}":')
            schema = {**(fn.get("parameters") or ANY_OBJECT), **COMPACT}
            rules.append(f"{rule}: {head} {rule}_args \"}}\"")
            rules.append(f"{rule}_args: %json {json.dumps(schema, ensure_ascii=False)}")
        return rules


class Hermes(ToolFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def grammar(self, tools, choice, parallel):
        # A named function is called once (OpenAI's and vLLM's reading), parallel or not.
        several = parallel and choice.mode != "named"
        start = 'start: call ("\\n" call)*' if several else "start: call"
        opening, closing = json.dumps(self.OPEN + "\n"), json.dumps("\n" + self.CLOSE)
        call = f"call: {opening} call_body {closing}"
        return "\n".join([start, call, *self._call_rules(tools, choice)])

    def parse(self, text):
        # Read as a stream of it reads it (stream.ToolCallStream), in one piece: a whole
        # answer and a streamed one never disagree.
        from producer.wire.tools.stream import read_whole

        return read_whole(self, text)


class Llama3Json(ToolFormat):
    name = "llama3_json"
    arguments_key = "parameters"
    # Llama's marker before a call of a built-in tool; also written before JSON ones.
    PYTHON_TAG = "<|python_tag|>"

    def grammar(self, tools, choice, parallel):
        return "\n".join(["start: call_body", *self._call_rules(tools, choice)])

    def parse(self, text):
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return ParsedAnswer(text)
        calls, decoder, at = [], json.JSONDecoder(), 0
        while at < len(body):
            try:
                value, end = decoder.raw_decode(body, at)
            except (ValueError, RecursionError):
                return ParsedAnswer(text)
            call = _call_from(value, self.arguments_key, body[at:end])
            at = end
            if call is None:
                return ParsedAnswer(text)
            calls.append(call)
            # Several calls, where a model writes them, are separated by ";" (vLLM reads so).
            at = _SEPARATOR.match(body, at).end()
        return ParsedAnswer(None, calls)

    def call_start(self, text):
        # A call is the whole answer: it begins at the answer's first non-blank character.
        stripped = text.lstrip()
        if not stripped:
            return None
        begin = len(text) - len(stripped)
        if stripped.startswith("{") or stripped.startswith(self.PYTHON_TAG):
            return begin
        return begin if self.PYTHON_TAG.startswith(stripped) else None


FORMATS = {f.name: f for f in (Hermes(), Llama3Json())}
_SEPARATOR = re.compile(r"\s*;?\s*")


def format_of_template(source: str | None) -> ToolFormat | None:
    """The tool-call format a chat template teaches its model: ``hermes`` where it writes
    ``<tool_call>`` blocks, ``llama3_json`` where it has Llama's ``ipython`` role; None where
    it renders no tools (or in a format conveyor does not read)."""
    if not source or "tools" not in source:
        return None
    if Hermes.OPEN in source:
        return FORMATS["hermes"]
    if "ipython" in source:
        return FORMATS["llama3_json"]
    return None


def call_of(body: str, key: str) -> dict[str, str] | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return _call_from(value, key, body)


def _call_from(value: Any, key: str, text: str) -> dict[str, str] | None:
    """``{"name", "arguments"}`` of a parsed call (``text``: its JSON as written): an object
    with a name and its arguments under either key a format may use (an object with a name
    alone is an answer's JSON, no call; so is one whose name could not be a tool's). The
    arguments are the text the model wrote for them, as OpenAI gives them, where the call
    opens with its name (scan.read_header: what a stream sends as it comes); else the
    object written compactly."""
    name = value.get("name") if isinstance(value, dict) else None
    # (a name as a tool's is named: JSON escapes in it could make a lone surrogate, which
    # no answer can carry)
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        return None
    arguments = value.get(key, value.get("arguments", value.get("parameters")))
    if not isinstance(arguments, dict):
        return None
    written = raw_arguments(text, name)
    if written is not None:
        return {"name": name, "arguments": written}
    try:  # (ASCII: a string's escapes may hold a lone surrogate)
        return {"name": name, "arguments": json.dumps(arguments, separators=(",", ":"))}
    except RecursionError:  # (nested deeper than the encoder goes: no call)
        return None


def raw_arguments(text: str, name: str) -> str | None:
    """The arguments' text of a call written name first (None: written otherwise)."""
    verdict, start, named = read_header(text)
    if verdict != CALL or named != name:
        return None
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
    except (ValueError, RecursionError):
        return None
    return text[start:end]


def ended_with_calls(finish_reason: str) -> str:
    """The finish reason of an answer that made calls: OpenAI's ``tool_calls`` where it
    ended by itself (``stop``); any other reason as it is."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def call_seed(request_id: str, choice: int) -> str:
    """What a choice's call ids are made from (``call_id``): the request and the choice."""
    return f"{request_id}.{choice}"


def call_id(seed: str, index: int) -> str:
    """A call's id in an answer: the same for the same request, choice and call (a resumed
    stream reads the ids it read before)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=12).hexdigest()
    return f"call_{digest}"


def openai_calls(calls: list[dict[str, str]], seed: str, first: int = 0) -> list[dict[str, Any]]:
    """An answer's calls in OpenAI's ``tool_calls`` shape (``first``: the index of the first
    among the answer's calls)."""
    return [{"id": call_id(seed, first + k), "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for k, c in enumerate(calls)]


def call_deltas(deltas: list[dict[str, Any]], seed: str) -> list[list[dict[str, Any]]]:
    """A streamed answer's call deltas (stream.ToolCallStream's) in OpenAI's shape: a call's
    first carries its id, type and name, the others a piece of its arguments; a client
    joins a call's deltas by their ``index``."""
    out = []
    for d in deltas:
        function = {"arguments": d["arguments"]}
        if "name" in d:
            out.append([{"index": d["index"], "id": call_id(seed, d["index"]),
                         "type": "function", "function": {"name": d["name"], **function}}])
        else:
            out.append([{"index": d["index"], "function": function}])
    return out
