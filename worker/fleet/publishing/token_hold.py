"""Tokens the engine loop holds back for the stream interval, before any publication exists.

At a GPU's step rate a decoding request gains a token every few milliseconds and its stream
is written once an interval (50 ms: ~10 steps). Making a chunk and a publication of every
step's token, and having the publisher take each one, look at it and hold it
(chunk_holder.py), cost the worker's one interpreter more than anything else it does per
token. For a request whose text needs no look at every token (no stop strings, no
log-probabilities), the engine loop keeps its new token ids on its in-flight entry instead,
and makes one chunk of them once the interval since its last chunk is over: the publisher
gets that chunk ready-joined (``Publication.coalesced``) and only detokenizes and writes it.

The same rules as the chunk holder's: a request's first token and its final go at once (the
final with everything held); a request a step leaves out (preempted, waiting for blocks) has
its tokens released with the first step's output after its interval is over, as if it had
been in that step (a release at once would write a chunk for every stall: under memory
pressure, several an interval); one dropped here (its lease lost) at once, and everything
when the loop pauses, idles or stops. Requests with stop strings or log-probabilities go
step by step to the publisher, whose text stage sees each token (a stop string ends the
request at once) and whose chunk holder joins them.
"""

from __future__ import annotations

from worker.fleet.inflight import InflightRequest


class TokenHold:
    """Held tokens of the in-flight entries that coalesce (``InflightRequest.coalesce``),
    released once ``interval_s`` of the loop's clock passed since their last chunk."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        # Entries holding tokens now, by request id.
        self._holding: dict[str, InflightRequest] = {}
        self.tokens = 0  # held now: part of the publisher lag (tokens made, not in Redis)

    def take(self, entry: InflightRequest, new_tokens: list[int], now: float,
             finished: bool) -> list[int] | None:
        """``entry``'s step gained ``new_tokens`` (a list of the caller's, kept): None when
        they are held, else the tokens to publish now, those held before them first."""
        if entry.coalesce and not finished and self._within_interval(entry, now):
            if entry.held is None:
                entry.held = []
                self._holding[entry.request_id] = entry
            entry.held.extend(new_tokens)
            self.tokens += len(new_tokens)
            return None
        tokens = self.release(entry) + new_tokens if entry.held else new_tokens
        entry.chunk_sent_at = now
        return tokens

    def release(self, entry: InflightRequest) -> list[int]:
        """``entry``'s held tokens (maybe none), no longer held."""
        held, entry.held = entry.held or [], None
        if held:
            self._holding.pop(entry.request_id, None)
            self.tokens -= len(held)
        return held

    def due(self, now: float) -> list[tuple[InflightRequest, list[int]]]:
        """Entries whose interval is over, with their tokens, released: after a step, those
        it left out (one it ran at ``now`` was released by ``take`` where due)."""
        due = [e for e in self._holding.values() if not self._within_interval(e, now)]
        return [(e, self._released_at(e, now)) for e in due]

    def release_all(self, now: float) -> list[tuple[InflightRequest, list[int]]]:
        return [(e, self._released_at(e, now)) for e in list(self._holding.values())]

    def _within_interval(self, entry: InflightRequest, now: float) -> bool:
        """Whether ``entry``'s last chunk went less than an interval before ``now``."""
        return entry.chunk_sent_at is not None and now - entry.chunk_sent_at < self.interval_s

    def _released_at(self, entry: InflightRequest, now: float) -> list[int]:
        entry.chunk_sent_at = now
        return self.release(entry)
