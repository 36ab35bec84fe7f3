"""Checks applied at the edge, before a value becomes part of a key or a request."""

from __future__ import annotations

import re

# Ids become parts of Redis keys: keep them short and free of separators.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


def validate_request_id(request_id: object) -> str:
    """Return the id unchanged, or raise ValueError saying what is wrong with it."""
    if not isinstance(request_id, str) or not REQUEST_ID_PATTERN.fullmatch(request_id):
        raise ValueError(
            f"request id must match [A-Za-z0-9_-]{{1,64}}, got {str(request_id)[:80]!r}"
        )
    return request_id


def validate_token_ids(token_ids: object, vocab_size: int, what: str = "prompt") -> list[int]:
    """A non-empty list of in-vocabulary ints, or a ValueError."""
    if not isinstance(token_ids, list | tuple) or not token_ids:
        raise ValueError(f"{what} must be a non-empty list of token ids")
    for t in token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"{what} has token id {t!r} outside the vocabulary [0, {vocab_size})")
    return list(token_ids)
