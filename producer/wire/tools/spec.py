"""OpenAI's ``tools``, ``tool_choice`` and an assistant message's ``tool_calls``, checked at
the edge and written in the one form every part of conveyor reads.

A tool is a function: ``{"type": "function", "function": {"name", "description"?,
"parameters"?, "strict"?}}``. Its ``parameters`` are a JSON Schema (an object's), held to
the same depth limit as a response_format's; all tools together at most MAX_TOOLS_CHARS of
JSON, since every one is rendered into the prompt and compiled into a forced call's
grammar. A tool call in the history carries its ``arguments`` as OpenAI sends them, a JSON
text; it is kept parsed (an object), as chat templates render it (transformers' and vLLM's
alike).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from producer.wire.response_format import MAX_SCHEMA_DEPTH, nesting_depth
from producer.wire.validation import brief, json_chars

MAX_TOOLS = 128
# All tools as JSON: each is rendered into the prompt and compiled into a forced call.
MAX_TOOLS_CHARS = 65_536
MAX_TOOL_CALLS = 128
# OpenAI's function names: letters, digits, underscores and dashes (dots too, as vLLM
# allows), at most 64.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_DESCRIPTION_CHARS = 8_192
MAX_CALL_ID_CHARS = 256
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolChoice:
    """What the model may do with the tools: ``none`` (answer in text), ``auto`` (its
    choice), ``required`` (at least one call), or ``named`` (a call of ``name``)."""

    mode: str = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        """A call is forced: the grammar writes one (formats.ToolFormat.grammar)."""
        return self.mode in ("required", "named")


def validate_tools(value: Any) -> list[dict[str, Any]] | None:
    """``value`` as a list of function tools (None: none offered), or a ValueError."""
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise ValueError(f"tools must be a list, got {brief(value)}")
    if not value:
        return None
    if len(value) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools, got {len(value)}")
    out, names = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ValueError(f"{where} must be {{\"type\": \"function\", \"function\": "
                             "{...}} (function tools only)")
        if extra := sorted(brief(k) for k in set(tool) - {"type", "function"}):
            raise ValueError(f"{where} has unknown field(s): {', '.join(extra[:4])}")
        fn = _function(where + ".function", tool.get("function"))
        if fn["name"] in names:
            raise ValueError(f"{where}.function.name {fn['name']!r} is given twice")
        names.add(fn["name"])
        out.append({"type": "function", "function": fn})
    size = json_chars(out, "tools")
    if size > MAX_TOOLS_CHARS:
        raise ValueError(f"tools are {size} characters of JSON, more than {MAX_TOOLS_CHARS}")
    return out


def validate_tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """``value`` (OpenAI's ``tool_choice``; None: ``auto`` with tools, ``none`` without) as a
    ToolChoice, or a ValueError: a named function must be one of ``tools``."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(CHOICES)} or "
                             f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                             f"got {brief(value)}")
        if value == "required" and not tools:
            raise ValueError("tool_choice required needs tools")
        return ToolChoice(value)
    if not isinstance(value, Mapping) or value.get("type") != "function":
        raise ValueError("tool_choice must be none, auto, required or {\"type\": "
                         "\"function\", \"function\": {\"name\": ...}}")
    function = value.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    names = [t["function"]["name"] for t in tools or ()]
    if name not in names:
        raise ValueError(f"tool_choice names {brief(name)}, which is not one of the tools "
                         f"({', '.join(names[:8]) or 'none given'})")
    return ToolChoice("named", name)


def validate_tool_calls(where: str, value: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``: ``[{"id", "type": "function", "function":
    {"name", "arguments"}}]`` with each ``arguments`` parsed from its JSON text."""
    if not isinstance(value, list | tuple) or not value or len(value) > MAX_TOOL_CALLS:
        raise ValueError(f"{where} must be a list of 1 to {MAX_TOOL_CALLS} calls")
    out = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(call, Mapping):
            raise ValueError(f"{at} must be a map with id, type and function")
        if extra := sorted(brief(k) for k in set(call) - {"id", "type", "function"}):
            raise ValueError(f"{at} has unknown field(s): {', '.join(extra[:4])}")
        if call.get("type", "function") != "function":
            raise ValueError(f"{at}.type must be function")
        fn = call.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{at}.function must be a map with a name and arguments")
        if not NAME_PATTERN.fullmatch(fn["name"]):
            raise ValueError(f"{at}.function.name must be 1 to 64 letters, digits, '_', '-' "
                             f"or '.', got {brief(fn['name'])}")
        kept = {"type": "function",
                "function": {"name": fn["name"], "arguments": _arguments(at, fn.get("arguments"))}}
        if call.get("id") is not None:
            if not isinstance(call["id"], str) or len(call["id"]) > MAX_CALL_ID_CHARS:
                raise ValueError(f"{at}.id must be a string of at most {MAX_CALL_ID_CHARS} "
                                 "characters")
            kept["id"] = call["id"]
        out.append(kept)
    return out


def validate_call_id(where: str, value: Any) -> str:
    """A tool message's ``tool_call_id``."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CALL_ID_CHARS:
        raise ValueError(f"{where}.tool_call_id must be a string of 1 to {MAX_CALL_ID_CHARS} "
                         f"characters, got {brief(value)}")
    return value


def _function(where: str, fn: Any) -> dict[str, Any]:
    if not isinstance(fn, Mapping):
        raise ValueError(f"{where} must be a map with a name")
    if extra := sorted(brief(k) for k in set(fn) - {"name", "description", "parameters",
                                                     "strict"}):
        raise ValueError(f"{where} has unknown field(s): {', '.join(extra[:4])}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"{where}.name must be 1 to 64 letters, digits, '_', '-' or '.', "
                         f"got {brief(name)}")
    out: dict[str, Any] = {"name": name}
    description = fn.get("description")
    if description is not None:
        if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS:
            raise ValueError(f"{where}.description must be a string of at most "
                             f"{MAX_DESCRIPTION_CHARS} characters")
        out["description"] = description
    parameters = fn.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
            raise ValueError(f"{where}.parameters must be a JSON Schema of an object")
        if nesting_depth(parameters) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{where}.parameters nests deeper than {MAX_SCHEMA_DEPTH}")
        out["parameters"] = dict(parameters)
    if fn.get("strict") is not None:
        if not isinstance(fn["strict"], bool):
            raise ValueError(f"{where}.strict must be true or false")
        out["strict"] = fn["strict"]
    return out


def _arguments(where: str, value: Any) -> dict[str, Any]:
    """A call's arguments: a JSON text of an object (OpenAI's form), or the object."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except (ValueError, RecursionError):  # (bad JSON, or nesting past the parser)
            raise ValueError(f"{where}.function.arguments must be a JSON object's text") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object, got "
                         f"{brief(value)}")
    if nesting_depth(value) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{where}.function.arguments nest deeper than {MAX_SCHEMA_DEPTH}")
    json_chars(value, f"{where}.function.arguments")
    return value


def calls_chars(calls: list[dict[str, Any]]) -> int:
    """What a message's checked ``tool_calls`` add to the messages' size: their names and
    arguments as JSON (counted with the contents against MAX_MESSAGES_CHARS)."""
    return sum(len(c["function"]["name"]) + len(json.dumps(c["function"]["arguments"]))
               for c in calls)

