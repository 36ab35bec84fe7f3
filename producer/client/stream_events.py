"""What streaming a request yields, and the pure logic turning output entries into it.

Both clients feed raw stream entries to an ``OutputTracker``; it decodes them, drops
token indexes already seen, refuses a stream that skips indexes (:class:`StreamGapError`)
and says when the final entry has arrived. No I/O here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from producer.wire.completion import Completion, FinishReason, TokenLogprob, Usage
from producer.wire.protocol import (
    ID_GENERATION,
    FinalEntry,
    OutputChunk,
    decode_output,
    entry_message,
)

# Stream ids a reader may resume from: "0", "0-0", "{ms}-{seq}".
_ENTRY_ID = re.compile(r"\d{1,20}(-\d{1,20})?")


@dataclass(frozen=True)
class ChunkEvent:
    """New tokens ``index .. index + len(token_ids) - 1`` and the text they added."""

    entry_id: str
    index: int
    token_ids: list[int]
    text: str
    # Per token, when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None
    # The first chunk of a request that asked for prompt logprobs: its prompt's ids and
    # each prompt token's logprob (None for the first).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


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


class StreamGapError(ValueError):
    """A request's output stream skips token indexes, or its final entry disagrees with the
    tokens delivered: tokens were lost on the way, and the output cannot be trusted.

    ``expected`` is the next token index the reader needed; ``found`` the index the entry
    starts at (a chunk) or the token count it claims (a final). Never glued over: a reader
    that meets one stops and raises it.
    """

    def __init__(self, request_id: str | None, entry_id: str, expected: int, found: int,
                 final: bool = False) -> None:
        who = f"request {request_id}" if request_id else "output stream"
        if final:
            detail = (f"final entry {entry_id} says {found} tokens but {expected} were "
                      f"delivered")
            if found > expected:
                detail += f" (token indexes {expected}..{found - 1} are missing)"
        else:
            detail = (f"expected token index {expected}, entry {entry_id} starts at {found} "
                      f"(token indexes {expected}..{found - 1} are missing)")
        super().__init__(f"{who}: gap in the output stream: {detail}")
        self.request_id = request_id
        self.entry_id = entry_id
        self.expected = expected
        self.found = found
        self.final = final


def validate_entry_id(entry_id: object) -> str:
    """A stream entry id to resume after, or a ValueError."""
    if not isinstance(entry_id, str) or not _ENTRY_ID.fullmatch(entry_id):
        raise ValueError(f"entry id must look like 12-0, got {str(entry_id)[:40]!r}")
    return entry_id


def entry_id_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a tuple that orders like Redis orders ids ("5" is "5-0")."""
    first, _, second = validate_entry_id(entry_id).partition("-")
    return int(first), int(second or 0)


def event_from(entry_id: bytes | str, fields: Any) -> StreamEvent:
    """One output entry as an event, on its own (no tracking); ProtocolError when malformed."""
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    entry = decode_output(entry_message(fields))
    if isinstance(entry, FinalEntry):
        return _final_event(eid, entry)
    return ChunkEvent(eid, entry.index, list(entry.token_ids), entry.text,
                      token_logprobs(entry.token_ids, entry.logprobs),
                      *_prompt_logprobs(entry))


def token_logprobs(token_ids: list[int],
                   wire: list[list[Any]] | None) -> list[TokenLogprob] | None:
    """A chunk's logprobs as TokenLogprobs (None when the request asked for none)."""
    if wire is None:
        return None
    return [TokenLogprob(t, lp, [(a, b) for a, b in top])
            for t, (lp, top) in zip(token_ids, wire, strict=True)]


def _prompt_logprobs(chunk: OutputChunk
                     ) -> tuple[list[int] | None, list[TokenLogprob | None] | None]:
    """A first chunk's prompt ids and prompt logprobs as TokenLogprobs (None, None without)."""
    if chunk.prompt_logprobs is None or chunk.prompt_token_ids is None:
        return None, None
    return chunk.prompt_token_ids, [
        None if item is None else TokenLogprob(t, item[0], [(a, b) for a, b in item[1]])
        for t, item in zip(chunk.prompt_token_ids, chunk.prompt_logprobs, strict=True)]


def _final_event(eid: str, entry: FinalEntry) -> FinalEvent:
    return FinalEvent(
        eid,
        entry.finish_reason,
        entry.num_tokens,
        {str(k): int(v) for k, v in entry.usage.items()},
        entry.error,
        entry.text,
    )


def next_index_after(entry_id: str) -> int:
    """First token index a reader resuming after ``entry_id`` has not seen.

    Chunk ``{i + 1}-0`` ends with token ``i`` and final ``{n}-1`` follows ``n`` tokens,
    so the id's first part counts the tokens up to and including that entry, modulo
    ID_GENERATION (a worker that took the request over writes ids above that).
    """
    return int(validate_entry_id(entry_id).split("-")[0]) % ID_GENERATION


class OutputTracker:
    """Turns one request's output entries into events, each token index once.

    A chunk that starts after the next expected index, or a final entry whose token count
    is not the number of tokens delivered, raises :class:`StreamGapError` (naming
    ``request_id`` when given).
    """

    def __init__(self, from_id: str = "0-0", request_id: str | None = None) -> None:
        self.request_id = request_id
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

    def feed(self, entry_id: bytes | str, fields: Any) -> StreamEvent | None:
        """Decode one entry; None when it holds no token index not yet yielded.

        StreamGapError when the entry shows that tokens were lost; the tracker then stays
        where it was (``last_id`` is not moved past the bad entry).
        """
        return self.feed_message(entry_id, entry_message(fields))

    def feed_message(self, entry_id: bytes | str, message: object) -> StreamEvent | None:
        """``feed`` for a reader that took the entry's message field out itself (a raw XREAD
        reply): the same checks, without a dict per entry."""
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        if self.final is not None:
            self.last_id = eid
            return None
        entry = decode_output(message)
        if isinstance(entry, FinalEntry):
            if entry.num_tokens != self.next_index:
                raise StreamGapError(self.request_id, eid, self.next_index, entry.num_tokens,
                                     final=True)
            self.last_id = eid
            self.final = _final_event(eid, entry)
            return self.final
        event = self._chunk(eid, entry)
        self.last_id = eid
        return event

    def _chunk(self, eid: str, chunk: OutputChunk) -> ChunkEvent | None:
        end = chunk.index + len(chunk.token_ids)
        if end <= self.next_index:
            return None
        if chunk.index > self.next_index:
            raise StreamGapError(self.request_id, eid, self.next_index, chunk.index)
        skip = max(0, self.next_index - chunk.index)
        if skip == 0 and chunk.logprobs is None and chunk.prompt_logprobs is None:
            # The usual entry: nothing to cut or convert.
            event = ChunkEvent(eid, chunk.index, chunk.token_ids, chunk.text)
            self._record(end, chunk.text)
            return event
        text = chunk.text if skip == 0 else self._strip_seen(chunk)
        logprobs = token_logprobs(chunk.token_ids, chunk.logprobs)
        event = ChunkEvent(eid, chunk.index + skip, list(chunk.token_ids[skip:]), text,
                           logprobs[skip:] if logprobs is not None else None,
                           *(_prompt_logprobs(chunk) if skip == 0 else (None, None)))
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
    logprobs: list[TokenLogprob] | None = None
    prompt: ChunkEvent | None = None
    final: FinalEvent | None = None
    for event in events:
        if isinstance(event, ChunkEvent):
            if event.prompt_logprobs is not None and prompt is None:
                prompt = event
            token_ids.extend(event.token_ids)
            texts.append(event.text)
            if event.logprobs is not None:
                logprobs = (logprobs or []) + event.logprobs
        else:
            final = event
            texts.append(event.text)
    if final is None:
        raise ValueError(f"request {request_id} has no final entry yet")
    usage = Usage(
        prompt_tokens=int(final.usage.get("prompt_tokens", 0)),
        completion_tokens=int(final.usage.get("completion_tokens", len(token_ids))),
        cached_tokens=int(final.usage.get("cached_tokens", 0)),
        kv_transferred_tokens=int(final.usage.get("kv_transferred_tokens", 0)),
    )
    return Completion(
        request_id,
        token_ids,
        "".join(texts),
        FinishReason(final.finish_reason),
        usage,
        logprobs=logprobs,
        error=final.error,
        prompt_token_ids=prompt.prompt_token_ids if prompt is not None else None,
        prompt_logprobs=prompt.prompt_logprobs if prompt is not None else None,
    )
