"""The affinity keys of a prompt: digests of its leading bytes at fixed lengths.

Two prompts that open with the same text share the keys of every level both reach: the
worker that served one holds the KV of that prefix, so the other should go to it. The keys
are made before tokenizing (producers load no tokenizer), from the prompt as the request
carries it: text, token ids, or chat messages with their tools and template variables (what
a chat template renders first). Levels grow by half each, from 1,536 bytes: the deepest
level inside a shared prefix covers at least two thirds of it.

A request carries the keys of its ``CARRIED_LEVELS`` deepest levels, deepest last (the
``affinity`` field, docs/protocol.md): producers look the deepest ones up, workers advertise
all of them, so a later prompt up to twice as long that opens with this one finds it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

# Bytes of the shortest prefix worth a key (~384 tokens of text or ids): a shorter shared
# opening saves a GPU a few milliseconds of prefill, less than routing costs every prompt
# that shares nothing (a lookup on submit, an advertisement: docs/affinity.md, "Cost").
FIRST_LEVEL = 1536
GROWTH = 1.5
# Prompts are at most 1,000,000 characters (up to 4 bytes each) or 262,144 token ids (4
# bytes each): levels reach past both.
MAX_PROMPT_BYTES = 4_000_000
LEVELS: tuple[int, ...] = tuple(int(FIRST_LEVEL * GROWTH ** i) for i in range(
    1 + int(math.log(MAX_PROMPT_BYTES / FIRST_LEVEL, GROWTH))))
# Keys a request carries: its deepest levels (1.5^2: a prompt a conversation's next turn
# made up to twice as long still finds it). Each is a field its server writes.
CARRIED_LEVELS = 3
# A request follows an owner only for a prefix at least this share of its prompt: a short
# common opening (a system prompt shared by every request) must not send every new
# document to one worker.
MIN_SHARE = 0.5
DIGEST_BYTES = 8


@dataclass(frozen=True)
class PrefixKeys:
    """A prompt's carried keys (deepest last) and the length of its canonical bytes."""

    keys: tuple[str, ...]
    length: int

    def lookup(self) -> tuple[str, ...]:
        """The keys a producer looks owners up for, deepest last: those whose level is at
        least MIN_SHARE of the prompt."""
        deepest = _deepest_level(self.length)
        out = []
        for i, key in enumerate(self.keys):
            level = LEVELS[deepest - (len(self.keys) - 1 - i)]
            if level >= MIN_SHARE * self.length:
                out.append(key)
        return tuple(out)


def _deepest_level(length: int) -> int:
    """Index of the deepest level a prompt of ``length`` bytes reaches (-1: none)."""
    return sum(1 for level in LEVELS if level <= length) - 1


def canonical_bytes(prompt: str | None = None, token_ids: list[int] | None = None,
                    messages: list[dict[str, Any]] | None = None,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> bytes:
    """One prompt as bytes, in the order a model reads it; kinds never collide (a text and
    token ids that happen to share bytes are different prompts to a worker)."""
    if prompt is not None:
        return b"t" + prompt.encode("utf-8", "surrogatepass")
    if token_ids is not None:
        return b"i" + b"".join(int(t).to_bytes(4, "little") for t in token_ids)
    parts = [b"m", _json(tools), _json(template_kwargs)]
    for message in messages or []:
        # Role and content first: a message's tool calls and ids follow it, as templates
        # render them.
        rest = {k: v for k, v in message.items() if k not in ("role", "content")}
        parts += [str(message.get("role", "")).encode(), _content(message.get("content")),
                  _json(rest) if rest else b""]
    return b"\x1e".join(parts)


def _content(content: Any) -> bytes:
    if isinstance(content, str):
        return content.encode("utf-8", "surrogatepass")
    return _json(content)


def _json(value: Any) -> bytes:
    return b"" if value is None else json.dumps(value, sort_keys=True,
                                                separators=(",", ":")).encode()


def prefix_keys(data: bytes) -> PrefixKeys:
    """The carried keys of a prompt's canonical bytes (none for one shorter than the first
    level). One pass over the bytes: each level's digest continues the last one's."""
    deepest = _deepest_level(len(data))
    first = max(0, deepest - CARRIED_LEVELS + 1)
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"conveyor-affin")
    keys, done, view = [], 0, memoryview(data)
    for i in range(deepest + 1):
        digest.update(view[done:LEVELS[i]])
        done = LEVELS[i]
        if i >= first:
            keys.append(digest.copy().hexdigest())
    return PrefixKeys(tuple(keys), len(data))
