"""Structured outputs: what a request's ``response_format`` asks of its text, checked at the
edge and turned into the grammar a worker constrains decoding with.

The grammar engine is llguidance (a Rust library, maintained beside guidance and used by
vLLM, SGLang and llama.cpp): it needs no torch and no tokenizer to compile and check a
grammar, so a producer or the gateway refuses a schema it cannot serve before anything is
queued; a worker builds the token masks from the same grammar. xgrammar, the other
maintained engine, ships as a torch extension.

Forms (OpenAI's first, then conveyor's):
- ``{"type": "text"}``: no constraint (stored as none).
- ``{"type": "json_object"}``: any JSON object.
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``:
  a JSON value valid against the schema.
- ``{"type": "regex", "regex": "..."}`` and ``{"type": "choice", "choices": ["a", "b"]}``.
- ``{"type": "grammar", "grammar": "..."}``: a grammar in llguidance's lark dialect (vLLM's
  ``guided_grammar``); the gateway writes one for a forced tool call
  (producer/wire/tools/formats.py).

JSON is compact unless the request asks otherwise (``"whitespace": "flexible"`` beside the
type): free whitespace between tokens lets a weak model wander without closing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from producer.wire.validation import brief

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# Limits on what one request may ask the grammar compiler for (docs/security.md).
MAX_SCHEMA_CHARS = 32_768
MAX_SCHEMA_DEPTH = 32
MAX_REGEX_CHARS = 4_096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1_024
# The grammar compiler's budgets, ours (pinned, not whatever a llguidance release defaults
# to): "fuel" is its unit of work, about 50,000 a ms building a grammar's lexer and 14,000 a
# ms making one row's mask. A grammar past them is refused, at the edge or as the
# request's error; a step's mask past its fuel or items ends the request with an error
# (worker/sampling/rows.py, make_masks).
COMPILE_FUEL = 1_000_000  # ~20 ms to build a grammar's lexer
STEP_FUEL = 200_000  # ~14 ms for one row's mask in a step
MAX_LEXER_STATES = 250_000  # ~1-2 KB each
MAX_GRAMMAR_SYMBOLS = 500_000
STEP_MAX_ITEMS = 50_000  # parser items a mask may make (~20,000 a ms)
MAX_ITEMS_IN_ROW = 2_000  # a grammar row's branching
# A lark grammar: room for a forced call of every tool a request may offer (MAX_TOOLS_CHARS
# of tools, in producer/wire/tools/spec.py) and the rules around them.
MAX_GRAMMAR_CHARS = 131_072


def canonical(value: Any) -> str | None:
    """``response_format`` checked and written as one canonical JSON text (None: no
    constraint); ValueError naming what is wrong. Equal formats give equal texts, so a
    worker compiles each once (``grammar_key``)."""
    if value is None:
        return None
    if isinstance(value, str):  # (already canonical: a SamplingParams copied)
        value = _loads(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"response_format must be an object, got {brief(value)}")
    kind = value.get("type")
    if kind == "text":
        extra = sorted(brief(k) for k in set(value) - {"type"})
        if extra:
            raise ValueError(f"response_format of type 'text' takes no other field; got "
                             f"{', '.join(extra)}")
        return None
    if kind not in KINDS:
        raise ValueError(f"response_format type must be one of text, {', '.join(KINDS)}; got "
                         f"{brief(kind)}")
    form: dict[str, Any] = {"type": kind}
    known = {"type", "whitespace"}
    if kind == "json_schema":
        known.add("json_schema")
        form["json_schema"] = _json_schema(value.get("json_schema"))
    elif kind == "regex":
        known.add("regex")
        regex = value.get("regex")
        if not isinstance(regex, str) or not regex or len(regex) > MAX_REGEX_CHARS:
            raise ValueError(f"response_format regex must be a non-empty string of at most "
                             f"{MAX_REGEX_CHARS} characters")
        form["regex"] = regex
    elif kind == "choice":
        known.add("choices")
        form["choices"] = _choices(value.get("choices"))
    elif kind == "grammar":
        known.add("grammar")
        grammar = value.get("grammar")
        if not isinstance(grammar, str) or not grammar.strip() or len(grammar) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"response_format grammar must be a non-empty lark grammar of at "
                             f"most {MAX_GRAMMAR_CHARS} characters")
        form["grammar"] = grammar
    unknown = sorted(brief(k) for k in set(value) - known)
    if unknown:
        raise ValueError(f"response_format has unknown field(s): {', '.join(unknown)}")
    whitespace = value.get("whitespace", "compact")
    if whitespace not in ("compact", "flexible"):
        raise ValueError(f"response_format whitespace must be compact or flexible, got "
                         f"{brief(whitespace)}")
    if whitespace == "flexible":
        form["whitespace"] = "flexible"
    # The schema's keys in the order given: a JSON answer writes its properties in their
    # order (a reasoning field before the answer it leads to). The form's own keys are in
    # the order written above, so equal formats still give equal texts.
    text = json.dumps(form, separators=(",", ":"), ensure_ascii=False)
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("response_format holds text that is not Unicode (a lone surrogate "
                         "escape such as \\ud800)") from None
    check_grammar(grammar_of(text))
    return text


def grammar_of(form: str) -> str:
    """The llguidance grammar of a canonical ``response_format`` text."""
    from llguidance import LLMatcher

    value = json.loads(form)
    kind = value["type"]
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value["regex"])
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(value["grammar"])
    if kind == "choice":
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value["choices"]))
    schema = value["json_schema"]["schema"] if kind == "json_schema" else {"type": "object"}
    flexible = value.get("whitespace") == "flexible"
    return LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": flexible})


def grammar_limits():
    """The compiler's budgets (llguidance's LLParserLimits), with terse errors: a verbose
    one quotes the grammar's insides, a client's schema, into logs and dead letters."""
    from llguidance import LLParserLimits

    return LLParserLimits(initial_lexer_fuel=COMPILE_FUEL, step_lexer_fuel=STEP_FUEL,
                          max_lexer_states=MAX_LEXER_STATES,
                          max_grammar_size=MAX_GRAMMAR_SYMBOLS, step_max_items=STEP_MAX_ITEMS,
                          max_items_in_row=MAX_ITEMS_IN_ROW, precompute_large_lexemes=True,
                          verbose_errors=False)


def check_grammar(grammar: str) -> None:
    """ValueError with the compiler's words where the grammar cannot be served."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar, limits=grammar_limits())
    if error:
        raise ValueError(f"response_format cannot be served: {error[:500]}")


def grammar_key(form: str) -> str:
    """A short key of a canonical format: workers cache its compiled grammar by it."""
    return hashlib.blake2b(form.encode(), digest_size=16).hexdigest()


def _json_schema(spec: Any) -> dict[str, Any]:
    if not isinstance(spec, Mapping):
        raise ValueError("response_format json_schema must be an object with a schema")
    extra = set(spec) - {"name", "schema", "strict", "description"}
    if extra:
        raise ValueError(f"response_format json_schema has unknown field(s): "
                         f"{', '.join(sorted(brief(k) for k in extra))}")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise ValueError("response_format json_schema.schema must be a JSON Schema object")
    if nesting_depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"response_format schema nests deeper than {MAX_SCHEMA_DEPTH}")
    text = json.dumps(schema, ensure_ascii=False)
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"response_format schema is {len(text)} characters of JSON, more "
                         f"than {MAX_SCHEMA_CHARS}")
    out: dict[str, Any] = {"schema": json.loads(text)}
    name = spec.get("name")
    if name is not None:
        if not isinstance(name, str) or len(name) > 64:
            raise ValueError("response_format json_schema.name must be a string of at most "
                             "64 characters")
        out["name"] = name
    if spec.get("strict") is not None:
        if not isinstance(spec["strict"], bool):
            raise ValueError("response_format json_schema.strict must be true or false")
        out["strict"] = spec["strict"]
    return out


def _choices(choices: Any) -> list[str]:
    if (not isinstance(choices, list) or not 0 < len(choices) <= MAX_CHOICES
            or not all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS
                       for c in choices)):
        raise ValueError(f"response_format choices must be 1 to {MAX_CHOICES} non-empty "
                         f"strings of at most {MAX_CHOICE_CHARS} characters")
    return list(choices)


def nesting_depth(value: Any, level: int = 1) -> int:
    """How deep ``value`` nests, counted no further than one past MAX_SCHEMA_DEPTH (a
    hostile schema may nest beyond any recursion limit)."""
    if level > MAX_SCHEMA_DEPTH:
        return level
    if isinstance(value, Mapping):
        return max((nesting_depth(v, level + 1) for v in value.values()), default=level)
    if isinstance(value, list):
        return max((nesting_depth(v, level + 1) for v in value), default=level)
    return level


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise ValueError("response_format must be an object") from None
