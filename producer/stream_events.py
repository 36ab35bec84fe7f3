"""What streaming a request yields, and the pure logic turning output entries into it.

Both clients feed raw stream entries to an ``OutputTracker``; it decodes them, drops
token indexes already seen and says when the final entry has arrived. No I/O here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from producer.wire.completion import Completion, FinishReason, Usage
from producer.wire.protocol import FIELD, FinalEntry, OutputChunk, decode_output

# Stream ids a reader may resume from: "0", "0-0", "{ms}-{seq}".
_ENTRY_ID = re.compile(r"\d{1,20}(-\d{1,20})?")


@dataclass(frozen=True)
class ChunkEvent:
    """New tokens ``index .. index + len(token_ids) - 1`` and the text they added."""

    entry_id: str
    index: int
    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class FinalEvent:
    """The request finished; nothing follows on its stream."""

    entry_id: str
    finish_reason: str
    num_tokens: int
    usage: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    # Text released only at the end (e.g. held back for a possible stop string).
    text: str = ""


StreamEvent = ChunkEvent | FinalEvent


def validate_entry_id(entry_id: object) -> str:
    """A stream entry id to resume after, or a ValueError."""
    if not isinstance(entry_id, str) or not _ENTRY_ID.fullmatch(entry_id):
        raise ValueError(f"entry id must look like 12-0, got {str(entry_id)[:40]!r}")
    return entry_id


def next_index_after(entry_id: str) -> int:
    """First token index a reader resuming after ``entry_id`` has not seen.

    Chunk ``{i + 1}-0`` ends with token ``i`` and final ``{n}-1`` follows ``n`` tokens,
    so the id's first part counts the tokens up to and including that entry.
    """
    return int(validate_entry_id(entry_id).split("-")[0])


class OutputTracker:
    """Turns one request's output entries into events, each token index once."""

    def __init__(self, from_id: str = "0-0") -> None:
        self.last_id = validate_entry_id(from_id)
        self.next_index = next_index_after(from_id)
        self.final: FinalEvent | None = None
        # Text pieces emitted so far, and how many preceded each chunk boundary (token index),
        # so an overlapping chunk's repeated text can be cut off exactly.
        self._texts: list[str] = []
        self._texts_before: dict[int, int] = {self.next_index: 0}

    @property
    def done(self) -> bool:
        return self.final is not None

    def feed(self, entry_id: bytes | str, fields: dict[bytes, bytes]) -> StreamEvent | None:
        """Decode one entry; None when it holds no token index not yet yielded."""
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        self.last_id = eid
        if self.final is not None:
            return None
        entry = decode_output(fields.get(FIELD))
        if isinstance(entry, FinalEntry):
            self.final = FinalEvent(
                eid,
                entry.finish_reason,
                entry.num_tokens,
                {str(k): int(v) for k, v in entry.usage.items()},
                entry.error,
                entry.text,
            )
            return self.final
        return self._chunk(eid, entry)

    def _chunk(self, eid: str, chunk: OutputChunk) -> ChunkEvent | None:
        end = chunk.index + len(chunk.token_ids)
        if end <= self.next_index:
            return None
        skip = max(0, self.next_index - chunk.index)
        text = chunk.text if skip == 0 else self._strip_seen(chunk)
        event = ChunkEvent(eid, chunk.index + skip, list(chunk.token_ids[skip:]), text)
        self._record(end, text)
        return event

    def _strip_seen(self, chunk: OutputChunk) -> str:
        # Text is per chunk, not per token: cut only a prefix we know we already emitted.
        first = self._texts_before.get(chunk.index)
        if first is not None:
            seen = "".join(self._texts[first:])
            if chunk.text.startswith(seen):
                return chunk.text[len(seen) :]
        return ""

    def _record(self, end: int, text: str) -> None:
        self._texts.append(text)
        self._texts_before[end] = len(self._texts)
        self.next_index = end


def completion_from(request_id: str, events: list[StreamEvent]) -> Completion:
    """Assemble a request's Completion from all of its events, the final one last."""
    token_ids: list[int] = []
    texts: list[str] = []
    final: FinalEvent | None = None
    for event in events:
        if isinstance(event, ChunkEvent):
            token_ids.extend(event.token_ids)
            texts.append(event.text)
        else:
            final = event
            texts.append(event.text)
    if final is None:
        raise ValueError(f"request {request_id} has no final entry yet")
    usage = Usage(
        prompt_tokens=int(final.usage.get("prompt_tokens", 0)),
        completion_tokens=int(final.usage.get("completion_tokens", len(token_ids))),
        cached_tokens=int(final.usage.get("cached_tokens", 0)),
    )
    return Completion(
        request_id,
        token_ids,
        "".join(texts),
        FinishReason(final.finish_reason),
        usage,
        error=final.error,
    )
