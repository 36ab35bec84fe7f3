"""Redis replies as text: ids, names and values come back as bytes from clients that do not
decode responses (the project's never do)."""

from __future__ import annotations


def as_text(value: object) -> str:
    """``value`` decoded when it is bytes, else its str()."""
    return value.decode() if isinstance(value, bytes) else str(value)
