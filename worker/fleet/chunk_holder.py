"""Fewer, larger output chunks: a decoding request's tokens go out every ``interval`` tokens.

Each chunk written costs a fixed price whatever it carries: the publisher's command, a
Redis write, and a wake-up and parse in every client that follows the stream. At 64
decoding requests that is 64 writes a step, and on a machine whose cores the engine shares
with Redis and the clients, their CPU is the engine's loss (docs/benchmarks.md, "Fleet vs
`--offline` throughput"). Holding a request's chunks until they carry ``interval`` tokens
divides that price by ``interval``; each token then waits up to ``interval - 1`` steps
longer to be seen. vLLM's ``stream_interval`` makes the same trade.

What is never held: a request's first chunk (time to first token stays as it is), a final
(with whatever was held before it, in one chunk), anything of a request that a batch does
not step (a preempted or waiting request's tokens do not wait for its next step), and
everything when the publisher closes. Held chunks are the publisher's prepared output:
stop strings were applied and text decoded before holding, so a stop is seen at once.
"""

from __future__ import annotations

from dataclasses import replace

from producer.wire.protocol import OutputChunk


def merged(first: OutputChunk, then: OutputChunk) -> OutputChunk:
    """One chunk with ``first``'s tokens then ``then``'s (which must follow them)."""
    logprobs = None
    if first.logprobs is not None or then.logprobs is not None:
        logprobs = (first.logprobs or []) + (then.logprobs or [])
    return OutputChunk(first.index, first.token_ids + then.token_ids, first.text + then.text,
                       logprobs)


def follows(first: OutputChunk, then: OutputChunk) -> bool:
    return first.index + len(first.token_ids) == then.index


class ChunkHolder:
    """Holds prepared publications (worker/fleet/publisher.py's ``Publication``) by request
    until their chunk carries ``interval`` tokens; ``release`` gives back what to write."""

    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"stream interval must be >= 1, got {interval}")
        self.interval = interval
        # Requests whose first chunk went out, and each one's held chunk (if any).
        self._started: set[str] = set()
        self._held: dict[str, OutputChunk] = {}

    @property
    def held_requests(self) -> int:
        return len(self._held)

    def release(self, items: list, ended: frozenset[str] | set[str] = frozenset(),
                flush_all: bool = False) -> list:
        """``items`` (one or more steps' prepared output, in order) less the chunks held
        back, with held chunks put before the next output of their request. Nothing stays
        held of a request in ``ended`` (ended here without a final of ours: cancelled, its
        lease lost, handed on), of one the items' steps leave out, or of any with
        ``flush_all`` (closing, or no step for a while)."""
        if self.interval == 1:
            return items
        from worker.fleet.publisher import Publication  # the publisher imports this module

        out: list = []
        stepped: set[str] = set()
        for item in items:
            rid = getattr(item, "request_id", None)
            if type(item) is not Publication:
                if rid is not None and rid in self._held:  # its tokens go out before it
                    out.append(Publication(rid, self._held.pop(rid)))
                out.append(item)
                continue
            stepped.add(rid)
            held = self._held.pop(rid, None)
            if item.final is not None:
                self._started.discard(rid)
                out.extend(self._before_final(rid, held, item))
                continue
            if item.chunk is None:
                if held is not None:
                    out.append(Publication(rid, held))
                out.append(item)
                continue
            if rid not in self._started:  # its first chunk: at once
                self._started.add(rid)
                if held is not None:
                    out.append(Publication(rid, held))
                out.append(item)
                continue
            chunk = item.chunk
            if held is not None:
                if follows(held, chunk):
                    chunk = merged(held, chunk)
                else:  # not contiguous (not expected): each goes as it is
                    out.append(Publication(rid, held))
            if len(chunk.token_ids) >= self.interval or item.ack is not None:
                out.append(item if chunk is item.chunk else replace(item, chunk=chunk))
            else:
                self._held[rid] = chunk
        for rid in ended:
            self._started.discard(rid)
        # Items with no step in them (the engine loop's other messages) say nothing of who
        # was stepped.
        for rid in [r for r in self._held
                    if flush_all or r in ended or (stepped and r not in stepped)]:
            out.append(Publication(rid, self._held.pop(rid)))
        return out

    @staticmethod
    def _before_final(rid: str, held: OutputChunk | None, item) -> list:
        """A final publication with the chunk held before it joined to its own."""
        if held is None:
            return [item]
        if item.chunk is None:
            return [replace(item, chunk=held)]
        if follows(held, item.chunk):
            return [replace(item, chunk=merged(held, item.chunk))]
        from worker.fleet.publisher import Publication

        return [Publication(rid, held), item]
