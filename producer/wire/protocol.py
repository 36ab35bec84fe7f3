"""The wire protocol: one versioned msgpack map per stream entry. No pickle anywhere.

Output stream entry ids are derived from token indexes, so Redis itself refuses a
write that would repeat a token index (a stale writer's XADD fails):
a chunk whose last token has index ``i`` gets id ``{i + 1}-0``, and the final entry
of a request with ``n`` tokens gets ``{n}-1``. A worker that takes a request over from
another (it claimed a lapsed lease) writes in the next generation of ids, ``g * 2**32``
above them (``ID_GENERATION``): it first moves the stream's last id there
(worker/fleet/intake/resume.py), so that nothing the worker it took the request from
still sends can land, whatever tokens a chunk of that worker's holds.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from producer.wire.keys import validate_lane, validate_name
from producer.wire.messages import validate_messages, validate_template_kwargs
from producer.wire.params import MAX_CHOICES, SamplingParams
from producer.wire.tools.spec import validate_tools
from producer.wire.validation import MAX_TOKEN_ID, brief, validate_request_id

SCHEMA_VERSION = 1
# Each stream entry holds one field with one msgpack map.
FIELD = b"m"
# The span of one writer generation's output entry ids: the g-th worker to take a request
# over writes ids from g * ID_GENERATION on; the tokens an id counts are its first part
# modulo this.
ID_GENERATION = 2**32
# Marks a field of an output entry's dataclass that its message does not carry.
NOT_ON_THE_WIRE = {"on_wire": False}

# Limits on one request entry; a producer is refused (ValueError) before writing past them
# and a worker dead-letters an entry that does.
MAX_ENTRY_BYTES = 4 * 2**20
# Most bytes a first chunk's prompt logprobs take a prompt token, with k alternatives: its id,
# [logprob, [[id, logprob] x k]] in msgpack (int32s and float64s, every header at its largest).
PROMPT_LOGPROB_BYTES = 20
PROMPT_ALTERNATIVE_BYTES = 15
# What a first chunk's prompt logprobs may take of its entry (the rest: its tokens and text).
MAX_PROMPT_LOGPROBS_BYTES = MAX_ENTRY_BYTES - 2**18


def check_prompt_logprobs_size(num_tokens: int, k: int) -> None:
    """ValueError where the logprobs of a prompt of ``num_tokens`` tokens with ``k``
    alternatives each would not fit in the first chunk's entry (the worker's rule, also
    applied by the gateway before it queues a request)."""
    each = PROMPT_LOGPROB_BYTES + k * PROMPT_ALTERNATIVE_BYTES
    if num_tokens * each > MAX_PROMPT_LOGPROBS_BYTES:
        raise ValueError(f"prompt_logprobs={k} of a prompt of {num_tokens} tokens would not "
                         f"fit in one output entry: at most {MAX_PROMPT_LOGPROBS_BYTES // each} "
                         "prompt tokens with that many alternatives")
MAX_PROMPT_CHARS = 1_000_000
MAX_PROMPT_TOKENS = 262_144
PRIORITY_RANGE = (-1000, 1000)
# Latest unix millisecond a created_ms or deadline_ms may hold (the end of year 9999).
MAX_UNIX_MS = 253_402_300_799_999
# Fields a request map may hold; any other is an error (a typo must not pass silently).
REQUEST_FIELDS = frozenset({"v", "id", "model", "prompt", "prompt_token_ids", "messages",
                            "params", "priority", "lane", "created_ms", "deadline_ms", "watch",
                            "chat_template_kwargs", "tools", "affinity"})
# Affinity keys a request may carry (producer/affinity/prefix_keys.py carries 3).
MAX_AFFINITY_KEYS = 8
_AFFINITY_KEY = re.compile(r"[0-9a-f]{16}")


class ProtocolError(ValueError):
    """A malformed message; ``request_id`` is set when the id itself was readable."""

    def __init__(self, reason: str, request_id: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.request_id = request_id


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class GenerationRequest:
    """One generation request as producers enqueue it: exactly one of ``prompt`` (text),
    ``prompt_token_ids`` or ``messages`` (chat turns, rendered by the model's chat template
    on the worker)."""

    request_id: str
    model: str
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    priority: int = 0
    lane: str = "interactive"
    created_ms: int = field(default_factory=now_ms)
    # Absolute deadline in unix milliseconds; None means none.
    deadline_ms: int | None = None
    # The producer's watch (``{ns}:watch:{watch}``): a worker cancels the request once that
    # key lapses, its producer gone. None: the request lives on its own.
    watch: str | None = None
    # Extra variables for the chat template (only with messages); None: none.
    chat_template_kwargs: dict[str, Any] | None = None
    # The functions the chat template renders for the model (producer/wire/tools/spec.py;
    # only with messages); None: none.
    tools: list[dict[str, Any]] | None = None
    # Digests of the prompt's leading bytes at growing lengths, deepest last
    # (producer/affinity/prefix_keys.py): the worker that serves it advertises that it holds
    # those prefixes, so that requests sharing one come to it. None: no affinity.
    affinity: list[str] | None = None

    def __post_init__(self) -> None:
        validate_request_id(self.request_id)
        if self.affinity is not None and not (
                isinstance(self.affinity, list) and 1 <= len(self.affinity) <= MAX_AFFINITY_KEYS
                and all(isinstance(k, str) and _AFFINITY_KEY.fullmatch(k)
                        for k in self.affinity)):
            raise ValueError(f"affinity must be a list of 1 to {MAX_AFFINITY_KEYS} keys of 16 "
                             f"hex digits, got {brief(self.affinity)}")
        if self.watch is not None:
            try:
                validate_request_id(self.watch)
            except ValueError:
                raise ValueError(f"watch must be an id like a request id, got "
                                 f"{brief(self.watch)}") from None
        validate_name("model", self.model)
        validate_lane(self.lane)
        given = [v is not None for v in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt (text), prompt_token_ids and messages")
        if self.chat_template_kwargs is not None:
            self.chat_template_kwargs = validate_template_kwargs(self.chat_template_kwargs)
            if self.chat_template_kwargs is not None and self.messages is None:
                raise ValueError("chat_template_kwargs needs messages (a chat request)")
        self.tools = validate_tools(self.tools)
        if self.tools is not None and self.messages is None:
            raise ValueError("tools need messages (a chat request)")
        if self.messages is not None:
            self.messages = validate_messages(self.messages)
        elif self.prompt is not None:
            if not isinstance(self.prompt, str) or not self.prompt:
                raise ValueError("prompt must be a non-empty string")
            if len(self.prompt) > MAX_PROMPT_CHARS:
                raise ValueError(f"prompt longer than {MAX_PROMPT_CHARS} characters")
        else:
            ids = self.prompt_token_ids
            if not isinstance(ids, list) or not ids or len(ids) > MAX_PROMPT_TOKENS:
                raise ValueError(f"prompt_token_ids must be a list of 1 to {MAX_PROMPT_TOKENS} ids")
            if not all(_int_in(t, 0, MAX_TOKEN_ID) for t in ids):
                raise ValueError(f"prompt_token_ids must be integers in [0, {MAX_TOKEN_ID}]")
        low, high = PRIORITY_RANGE
        if not _int_in(self.priority, low, high):
            raise ValueError(
                f"priority must be an integer in [{low}, {high}], got {brief(self.priority)}"
            )
        if not _int_in(self.created_ms, 0, MAX_UNIX_MS):
            raise ValueError(f"created_ms must be an integer in [0, {MAX_UNIX_MS}] (unix ms), "
                             f"got {brief(self.created_ms)}")
        if self.deadline_ms is not None and not _int_in(self.deadline_ms, 0, MAX_UNIX_MS):
            raise ValueError(f"deadline_ms must be None or an integer in [0, {MAX_UNIX_MS}] "
                             f"(unix ms), got {brief(self.deadline_ms)}")

    def encode(self) -> bytes:
        """The entry's message; ValueError when it would exceed MAX_ENTRY_BYTES."""
        m = {
            "v": SCHEMA_VERSION,
            "id": self.request_id,
            "model": self.model,
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "params": self.params.to_dict(),
            "priority": self.priority,
            "lane": self.lane,
            "created_ms": self.created_ms,
            "deadline_ms": self.deadline_ms,
        }
        if self.messages is not None:
            # Only when given: a worker from before chat refuses the field, never a prompt.
            m["messages"] = self.messages
        if self.watch is not None:  # the same: only requests that carry one
            m["watch"] = self.watch
        if self.chat_template_kwargs is not None:  # the same
            m["chat_template_kwargs"] = self.chat_template_kwargs
        if self.tools is not None:  # the same
            m["tools"] = self.tools
        if self.affinity is not None:  # the same
            m["affinity"] = self.affinity
        try:
            data = _pack(m)
        except (OverflowError, ValueError, TypeError) as exc:  # a number msgpack cannot hold
            raise ValueError(f"request cannot be encoded: {exc}") from None
        if len(data) > MAX_ENTRY_BYTES:
            raise ValueError(f"request is {len(data)} bytes encoded, more than {MAX_ENTRY_BYTES}")
        return data

    @classmethod
    def decode(cls, data: bytes) -> GenerationRequest:
        """Parse and validate; raises ProtocolError with the id when it could be read.

        Whatever the bytes hold, the only exception is ProtocolError: a hostile entry must
        never take down the thread reading it.
        """
        m = _unpack(data)
        rid = m.get("id")
        rid = rid if isinstance(rid, str) and _valid_id(rid) else None
        try:
            _check_version(m)
            if unknown := sorted(brief(k) for k in set(m) - REQUEST_FIELDS):
                raise ValueError(f"unknown request field(s): {', '.join(unknown[:8])}")
            params = m.get("params")
            params = {} if params is None else params
            if not isinstance(params, dict):
                raise ValueError(f"params must be a map, got {brief(params)}")
            return cls(
                request_id=m.get("id"),
                model=m.get("model"),
                params=SamplingParams.from_dict(params),
                prompt=m.get("prompt"),
                prompt_token_ids=m.get("prompt_token_ids"),
                messages=m.get("messages"),
                priority=m.get("priority", 0),
                lane=m.get("lane", "interactive"),
                created_ms=m.get("created_ms", 0),
                deadline_ms=m.get("deadline_ms"),
                watch=m.get("watch"),
                chat_template_kwargs=m.get("chat_template_kwargs"),
                tools=m.get("tools"),
                affinity=m.get("affinity"),
            )
        except (ValueError, TypeError) as exc:
            raise ProtocolError(str(exc), rid) from None
        except Exception as exc:  # a validation bug must dead-letter the entry, not kill intake
            raise ProtocolError(f"invalid request ({type(exc).__name__})", rid) from None


@dataclass(slots=True)
class OutputChunk:
    """Tokens ``index .. index + len(token_ids) - 1`` of a request and their text."""

    index: int
    token_ids: list[int]
    text: str = ""
    # Of a request that asked for logprobs: per token, [its logprob, [[id, logprob], ...]
    # of the most likely alternatives].
    logprobs: list[list[Any]] | None = None
    # The first chunk (index 0) of a request that asked for prompt logprobs: its prompt's
    # ids and, per prompt token, nil (the first) or [logprob, [[id, logprob], ...]].
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[list[Any] | None] | None = None
    # Where its writer's generation of entry ids starts (0, or k * ID_GENERATION for a
    # request taken over); not part of the message.
    id_base: int = field(default=0, repr=False, compare=False, metadata=NOT_ON_THE_WIRE)

    @property
    def entry_id(self) -> str:
        return f"{self.id_base + self.index + len(self.token_ids)}-0"

    def encode(self) -> bytes:
        m = {
            "v": SCHEMA_VERSION,
            "kind": "chunk",
            "index": self.index,
            "token_ids": self.token_ids,
            "text": self.text,
        }
        if self.logprobs is not None:
            m["logprobs"] = self.logprobs
        if self.prompt_logprobs is not None:
            m["prompt_token_ids"] = self.prompt_token_ids
            m["prompt_logprobs"] = self.prompt_logprobs
        return _pack(m)


@dataclass(slots=True)
class FinalEntry:
    """The last entry of a request's output stream."""

    finish_reason: str
    num_tokens: int
    usage: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    # Text released only at the end (held back for a possible stop string, say), if any.
    text: str = ""
    # As OutputChunk.id_base: not part of the message.
    id_base: int = field(default=0, repr=False, compare=False, metadata=NOT_ON_THE_WIRE)

    @property
    def entry_id(self) -> str:
        return f"{self.id_base + self.num_tokens}-1"

    def encode(self) -> bytes:
        return _pack(
            {
                "v": SCHEMA_VERSION,
                "kind": "final",
                "finish_reason": self.finish_reason,
                "num_tokens": self.num_tokens,
                "usage": self.usage,
                "error": self.error,
                "text": self.text,
            }
        )


def entry_message(fields: Any) -> Any:
    """An output entry's message (its FIELD), from its fields as redis-py parses them (a
    dict) or as a raw XREAD reply holds them ([field, value, ...]); None without one (which
    decode_output refuses)."""
    if isinstance(fields, dict):
        return fields.get(FIELD)
    if len(fields) == 2 and fields[0] == FIELD:  # every output entry: one field
        return fields[1]
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == FIELD:
            return fields[i + 1]
    return None


def decode_output(data: bytes) -> OutputChunk | FinalEntry:
    """Parse one output stream entry."""
    m = _unpack(data)
    try:
        _check_version(m)
        if m.get("kind") == "chunk":
            logprobs = m.get("logprobs")
            if logprobs is not None:
                logprobs = [_wire_logprob(item) for item in logprobs]
            chunk = OutputChunk(int(m["index"]), list(m["token_ids"]), str(m.get("text", "")),
                                logprobs)
            if (prompt := m.get("prompt_logprobs")) is not None:
                chunk.prompt_token_ids = [int(t) for t in m["prompt_token_ids"]]
                chunk.prompt_logprobs = [None if item is None else _wire_logprob(item)
                                         for item in prompt]
                if len(chunk.prompt_token_ids) != len(chunk.prompt_logprobs):
                    raise ValueError("prompt_logprobs and prompt_token_ids differ in length")
            return chunk
        if m.get("kind") == "final":
            return FinalEntry(
                str(m["finish_reason"]),
                int(m["num_tokens"]),
                dict(m.get("usage") or {}),
                m.get("error"),
                str(m.get("text", "")),
            )
        raise ValueError(f"unknown output entry kind {m.get('kind')!r}")
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed output entry: {exc}") from None


def declared_choices(data: Any) -> int:
    """How many choices (``params.n``) an entry asks for, as far as it can be read: an
    entry refused as malformed is answered on every choice's stream. 1 where unreadable."""
    try:
        params = _unpack(data).get("params")
        n = params.get("n", 1) if isinstance(params, dict) else 1
    except Exception:  # noqa: BLE001 (any garbage: one stream to answer)
        return 1
    return n if _int_in(n, 1, MAX_CHOICES) else 1


def _wire_logprob(item: Any) -> list[Any]:
    """One token's [logprob, [[id, logprob], ...]] as read, checked and typed."""
    lp, top = item
    return [float(lp), [[int(t), float(a)] for t, a in top]]


def error_final(reason: str, num_tokens: int = 0, id_base: int = 0) -> FinalEntry:
    """The final entry of a request that failed."""
    return FinalEntry("error", num_tokens, {}, reason[:2000], id_base=id_base)


def _valid_id(rid: str) -> bool:
    try:
        validate_request_id(rid)
        return True
    except ValueError:
        return False


def _int_in(value: object, low: int, high: int) -> bool:
    # bool is an int subclass: True is a caller bug, not 1.
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _check_version(m: dict[str, Any]) -> None:
    v = m.get("v")
    if not _int_in(v, SCHEMA_VERSION, SCHEMA_VERSION):
        raise ValueError(
            f"unsupported schema version {brief(v)} (this side speaks {SCHEMA_VERSION})"
        )


def _pack(m: dict[str, Any]) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


def _unpack(data: Any) -> dict[str, Any]:
    if not isinstance(data, bytes | bytearray):
        raise ProtocolError("entry has no message field")
    if len(data) > MAX_ENTRY_BYTES:
        raise ProtocolError(f"entry larger than {MAX_ENTRY_BYTES} bytes")
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}") from None
    if not isinstance(m, dict):
        raise ProtocolError("message is not a map")
    return m
