"""Chat messages as a request carries them: ``[{"role": ..., "content": "...", "name":
...}]`` (``name`` optional, passed to the chat template, which may use it or not).

Only what every chat template understands: a role, a string content and a name. Anything
richer (images, tool calls) is refused at the edge with a message naming it, never dropped
silently; the gateway joins OpenAI's text parts into one string before they get here.
"""

from __future__ import annotations

from typing import Any

from producer.wire.validation import brief

# The roles chat templates know; "developer" is OpenAI's newer name for "system".
ROLES = ("system", "developer", "user", "assistant")
MAX_MESSAGES = 1024
# All contents together: the same bound as a text prompt.
MAX_MESSAGES_CHARS = 1_000_000
# A participant's name (OpenAI allows 64 characters of [a-zA-Z0-9_-]; any text is kept here).
MAX_NAME_CHARS = 256


def validate_messages(value: Any) -> list[dict[str, str]]:
    """``value`` as a list of ``{"role", "content"}`` maps, or a ValueError saying what is
    wrong with it."""
    if not isinstance(value, list | tuple):
        raise ValueError(f"messages must be a non-empty list, got {brief(value)}")
    if not value:
        raise ValueError("messages must be a non-empty list, got an empty list")
    if len(value) > MAX_MESSAGES:
        raise ValueError(f"at most {MAX_MESSAGES} messages, got {len(value)}")
    out: list[dict[str, str]] = []
    total = 0
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a map with role and content, "
                             f"got {brief(message)}")
        if extra := sorted(brief(k) for k in set(message) - {"role", "content", "name"}):
            raise ValueError(f"messages[{i}] has unsupported field(s): {', '.join(extra[:4])} "
                             "(only role, content and name)")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, "
                             f"got {brief(role)}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {brief(content)}")
        total += len(content)
        if total > MAX_MESSAGES_CHARS:
            raise ValueError(f"messages longer than {MAX_MESSAGES_CHARS} characters in all")
        kept = {"role": role, "content": content}
        if "name" in message:
            name = message["name"]
            if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
                raise ValueError(f"messages[{i}].name must be a string of 1 to "
                                 f"{MAX_NAME_CHARS} characters, got {brief(name)}")
            kept["name"] = name
        out.append(kept)
    return out
