"""Chat messages as a request carries them: ``[{"role": ..., "content": "...", "name":
...}]`` (``name`` optional, passed to the chat template, which may use it or not), and the
tool-call history: an assistant message's ``tool_calls`` (its content then may be null:
kept as ""), a ``tool`` message's result with its ``tool_call_id``
(producer/wire/tools/spec.py).

Anything richer (images, audio) is refused at the edge with a message naming it, never
dropped silently; the gateway joins OpenAI's text parts into one string before they get
here.
"""

from __future__ import annotations

from typing import Any

from producer.wire.tools.spec import calls_chars, validate_call_id, validate_tool_calls
from producer.wire.validation import brief, json_chars

# The roles chat templates know; "developer" is OpenAI's newer name for "system"; "tool"
# carries a tool call's result.
ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields beyond role, content and name, by the role that may carry them.
ROLE_FIELDS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}
MAX_MESSAGES = 1024
# All contents (and tool calls' names and arguments) together: the same bound as a text
# prompt.
MAX_MESSAGES_CHARS = 1_000_000
# chat_template_kwargs: extra variables for the chat template (e.g. a Qwen-style
# enable_thinking), as JSON at most this long, and never one of the names the renderer sets.
MAX_TEMPLATE_KWARGS_CHARS = 16 * 1024
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "add_generation_prompt", "tools", "documents", "strftime_now",
    "raise_exception", "bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
    "cls_token", "mask_token",
    # Jinja's own names: a template that calls range() must get range, and "self" is the
    # template itself.
    "range", "dict", "lipsum", "cycler", "joiner", "namespace", "self"})
# A participant's name (OpenAI allows 64 characters of [a-zA-Z0-9_-]; any text is kept here).
MAX_NAME_CHARS = 256


def validate_messages(value: Any) -> list[dict[str, Any]]:
    """``value`` as a list of ``{"role", "content"}`` maps, or a ValueError saying what is
    wrong with it."""
    if not isinstance(value, list | tuple):
        raise ValueError(f"messages must be a non-empty list, got {brief(value)}")
    if not value:
        raise ValueError("messages must be a non-empty list, got an empty list")
    if len(value) > MAX_MESSAGES:
        raise ValueError(f"at most {MAX_MESSAGES} messages, got {len(value)}")
    out: list[dict[str, Any]] = []
    total = 0
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a map with role and content, "
                             f"got {brief(message)}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, "
                             f"got {brief(role)}")
        fields = {"role", "content", "name"} | ROLE_FIELDS.get(role, set())
        if extra := sorted(brief(k) for k in set(message) - fields):
            raise ValueError(f"messages[{i}] has unsupported field(s): {', '.join(extra[:4])} "
                             f"(a {role} message holds {', '.join(sorted(fields))})")
        calls = None
        if message.get("tool_calls") is not None:
            calls = validate_tool_calls(f"messages[{i}].tool_calls", message["tool_calls"])
            total += calls_chars(calls)
            content = "" if content is None else content  # (OpenAI's null beside calls)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {brief(content)}")
        total += len(content)
        if total > MAX_MESSAGES_CHARS:
            raise ValueError(f"messages longer than {MAX_MESSAGES_CHARS} characters in all "
                             "(contents and tool calls' arguments)")
        kept: dict[str, Any] = {"role": role, "content": content}
        if calls is not None:
            kept["tool_calls"] = calls
        if role == "tool":
            kept["tool_call_id"] = validate_call_id(f"messages[{i}]", message.get("tool_call_id"))
        if "name" in message:
            name = message["name"]
            if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
                raise ValueError(f"messages[{i}].name must be a string of 1 to "
                                 f"{MAX_NAME_CHARS} characters, got {brief(name)}")
            kept["name"] = name
        out.append(kept)
    return out


def validate_template_kwargs(value: Any) -> dict[str, Any] | None:
    """``value`` as chat_template_kwargs: a map from names (ASCII identifiers, none of
    RESERVED_TEMPLATE_NAMES) to JSON values, at most MAX_TEMPLATE_KWARGS_CHARS as JSON, None
    for an empty one (nothing to send); or a ValueError saying what is wrong with it."""
    if not isinstance(value, dict):
        raise ValueError(f"chat_template_kwargs must be a map, got {brief(value)}")
    if not value:
        return None
    for name in value:
        if not isinstance(name, str) or not name.isascii() or not name.isidentifier():
            raise ValueError(f"chat_template_kwargs names must be identifiers, got "
                             f"{brief(name)}")
        if name in RESERVED_TEMPLATE_NAMES:
            raise ValueError(f"chat_template_kwargs may not set {name!r} (the renderer sets "
                             "it)")
    size = json_chars(value, "chat_template_kwargs values")
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise ValueError(f"chat_template_kwargs larger than {MAX_TEMPLATE_KWARGS_CHARS} "
                         "characters of JSON")
    return dict(value)
