"""Checks applied at the edge, before a value becomes part of a key or a request."""

from __future__ import annotations

import json
import re

# Ids become parts of Redis keys: keep them short and free of separators.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Largest token id any field may hold: above every real vocabulary, and a 32-bit int, so a
# hostile value can neither overflow a tensor nor fail to encode.
MAX_TOKEN_ID = 2**31 - 1
# Characters of an untrusted value quoted in an error message.
BRIEF_CHARS = 40


def brief(value: object) -> str:
    """A short description of an untrusted value for an error message.

    Never the whole of a huge string, and never a repr of a container: a deeply nested
    one would raise RecursionError, a huge one would flood logs and dead letters.
    """
    if isinstance(value, str):
        return repr(value[:BRIEF_CHARS]) + ("..." if len(value) > BRIEF_CHARS else "")
    if value is None or isinstance(value, bool | float):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 128 else f"an int of {value.bit_length()} bits"
    if isinstance(value, bytes | bytearray):
        return f"{len(value)} bytes"
    return f"a {type(value).__name__}"


def validate_request_id(request_id: object) -> str:
    """Return the id unchanged, or raise ValueError saying what is wrong with it."""
    if not isinstance(request_id, str) or not REQUEST_ID_PATTERN.fullmatch(request_id):
        raise ValueError(f"request id must match [A-Za-z0-9_-]{{1,64}}, got {brief(request_id)}")
    return request_id


# Choice i > 0 of a request with n choices (params.n) is served and streamed as "{id}.{i}":
# a dot is never part of a request id, so no request's id can be a choice's.
CHOICE_ID_PATTERN = re.compile(r"([A-Za-z0-9_-]{1,64})(?:\.([1-9][0-9]{0,2}))?")


def choice_id(request_id: str, index: int) -> str:
    """The id choice ``index`` of request ``request_id`` is served under: the request's own
    for choice 0, ``{id}.{index}`` after it."""
    return request_id if index == 0 else f"{request_id}.{index}"


def request_of(choice: str) -> str:
    """The request id a choice id belongs to (a request id is its own)."""
    return choice.partition(".")[0]


def validate_choice_id(value: object) -> str:
    """A request id, or a choice id ``{id}.{i}`` (1 <= i <= 999); ValueError otherwise."""
    if not isinstance(value, str) or not CHOICE_ID_PATTERN.fullmatch(value):
        raise ValueError(f"request id must match [A-Za-z0-9_-]{{1,64}}, or be one followed by "
                         f"'.' and a choice number, got {brief(value)}")
    return value


def validate_token_ids(token_ids: object, vocab_size: int, what: str = "prompt") -> list[int]:
    """A non-empty list of in-vocabulary ints, or a ValueError."""
    if not isinstance(token_ids, list | tuple) or not token_ids:
        raise ValueError(f"{what} must be a non-empty list of token ids")
    for t in token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"{what} has token id {brief(t)} outside the vocabulary "
                             f"[0, {vocab_size})")
    return list(token_ids)


def json_chars(value: object, what: str) -> int:
    """How many characters ``value`` takes as JSON; ValueError naming ``what`` where it is
    not JSON (a set, NaN, a nesting past the encoder)."""
    try:
        return len(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        raise ValueError(f"{what} must be JSON (strings, numbers, booleans, null, lists and "
                         "maps)") from None
