"""Fewer, larger output chunks: a decoding request's tokens go out at most once an interval.

Each chunk written costs a fixed price whatever it carries: the publisher's command, a
Redis write, and a wake-up and parse in every client that follows the stream. At 256
decoding requests and a step every 5 ms (a GPU) that is 51,200 writes a second for one
worker (docs/redis.md). Holding a request's chunks until ``interval_s`` has passed since
its last chunk went out bounds its writes to one an interval, whatever the step rate; a
reader sees each token at most ``interval_s`` later, and every token at once where they
come slower than that. (``tokens``, the older way, holds them until they number that
many: a count of steps means nothing to a reader who does not know the step rate.)

What is never held: a request's first chunk (time to first token stays as it is), a final
(with whatever was held before it, in one chunk), anything of a request that ended here
(cancelled, its lease lost), and everything when the publisher closes or the engine idles.
A request that a step leaves out (preempted, waiting for blocks) does not wait for its next
step: with an interval, its chunk goes once the interval is over, stepped or not (at once,
it would write a chunk each time it stalls); held by a count of tokens alone, at once.
Held chunks are the publisher's prepared output: stop strings were applied before holding,
so a stop is seen at once (the text of a request without stop strings is made as its chunk
leaves: text_stage.py, ``fill``).

A joined chunk is one XADD. Its entry id says only where it ends, so two writers of one
request (a worker that lost its lease and the one that claimed it) that joined different
runs of tokens could write some indexes twice, were they writing ids of one generation:
the claiming worker takes the stream over first (worker/fleet/intake/resume.py), after
which Redis refuses every id the other still sends.
"""

from __future__ import annotations

from dataclasses import replace

from producer.clock import SYSTEM_CLOCK, Clock
from producer.wire.protocol import OutputChunk
from worker.fleet.messages import Publication


def joined(pieces: list[OutputChunk]) -> OutputChunk:
    """One chunk with the pieces' tokens, text and log-probabilities, in order."""
    first = pieces[0]
    if len(pieces) == 1:
        return first
    logprobs = None if first.logprobs is None else [lp for p in pieces for lp in p.logprobs]
    return OutputChunk(first.index, [t for p in pieces for t in p.token_ids],
                       "".join(p.text for p in pieces), logprobs, first.prompt_token_ids,
                       first.prompt_logprobs, id_base=first.id_base)


def follows(pieces: list[OutputChunk], then: OutputChunk) -> bool:
    """Whether ``then`` can join ``pieces``: its tokens come right after theirs, and it has
    log-probabilities exactly when they do (a joined chunk's must match its tokens)."""
    last = pieces[-1]
    return (last.index + len(last.token_ids) == then.index
            and (last.logprobs is None) == (then.logprobs is None))


class ChunkHolder:
    """Holds prepared publications (publisher.py's ``Publication``) by request until
    ``interval_s`` seconds of ``clock`` passed since the request's last chunk went out, or
    until they carry ``tokens`` tokens (each where given); ``release`` gives back what to
    write. Neither given, an interval of 0 or 1 token: everything goes at once."""

    def __init__(self, tokens: int | None = None, interval_s: float | None = None,
                 clock: Clock | None = None) -> None:
        if tokens is not None and tokens < 1:
            raise ValueError(f"stream interval must be >= 1 token, got {tokens}")
        if interval_s is not None and not interval_s >= 0:
            raise ValueError(f"stream interval must be >= 0 ms, got {interval_s * 1000}")
        self.tokens = tokens
        self.interval_s = interval_s
        self.clock = clock or SYSTEM_CLOCK
        self.passes_through = tokens == 1 or interval_s == 0 or (
            tokens is None and interval_s is None)
        # Requests whose first chunk went out, with when their last chunk did, and each
        # one's held chunks (if any).
        self._sent_at: dict[str, float] = {}
        self._held: dict[str, list[OutputChunk]] = {}

    @property
    def held_requests(self) -> int:
        return len(self._held)

    def next_due(self) -> float | None:
        """Seconds until a held request's interval is over (0: now); None when nothing
        waits for time (nothing held, or no interval)."""
        if not self._held or self.interval_s is None:
            return None
        now = self.clock.monotonic()
        first = min(self._sent_at.get(rid, now) for rid in self._held)
        return max(0.0, first + self.interval_s - now)

    def _due(self, rid: str, pieces: list[OutputChunk], now: float) -> bool:
        if self.tokens is not None and sum(len(p.token_ids) for p in pieces) >= self.tokens:
            return True
        # (A nanosecond's slack: an interval measured as a sum of float seconds.)
        return self.interval_s is not None and now - self._sent_at.get(rid, now) >= \
            self.interval_s - 1e-9

    def release(self, items: list, ended: frozenset[str] | set[str] = frozenset(),
                flush_all: bool = False) -> list:
        """``items`` (one or more steps' prepared output, in order) less the chunks held
        back, with held chunks put before the next output of their request. Nothing stays
        held of a request in ``ended`` (ended here without a final of ours: cancelled, its
        lease lost, handed on), of one whose interval is over, stepped or not, of one the
        items' steps leave out where there is no interval (held by a count of tokens), or
        of any with ``flush_all`` (closing, or no step for a while).

        A request's joined chunk (with its final, if any) is the last of its output in what
        this returns, and there is at most one; whatever must go before something else
        goes as its steps' chunks, one by one."""
        if self.passes_through:
            return items
        now = self.clock.monotonic()
        out: list = []
        # This call's pieces by request (held ones first), in the order requests came.
        taken: dict[str, list[OutputChunk]] = {}
        for item in items:
            rid = getattr(item, "request_id", None)
            if type(item) is not Publication:
                out.extend(self._singly(rid, self._take(rid, taken)))  # before it
                out.append(item)
                continue
            if item.coalesced and rid not in self._held and rid not in taken:
                out.append(item)  # held by the engine loop already (token_hold.py)
                if item.final is None:
                    self._sent_at[rid] = now
                else:
                    self._sent_at.pop(rid, None)
                continue
            if rid not in self._sent_at and rid not in self._held and rid not in taken:
                if item.final is None:  # its first chunk: at once
                    self._sent_at[rid] = now
                out.append(item)
                continue
            pieces = self._take(rid, taken)
            if item.chunk is not None:
                if pieces and not follows(pieces, item.chunk):  # not joinable
                    out.extend(self._singly(rid, pieces))
                    pieces = []
                pieces.append(item.chunk)
            if item.final is None:
                if pieces:  # (a publication with neither a chunk nor a final adds nothing)
                    taken[rid] = pieces
                continue
            self._sent_at.pop(rid, None)  # its end: with what came before it
            out.append(replace(item, chunk=joined(pieces)) if pieces else item)
        stepped = set(taken)
        for rid, pieces in taken.items():
            if flush_all or rid in ended or self._due(rid, pieces, now):
                out.append(self._publication(rid, pieces))
                self._sent_at[rid] = now
            else:
                self._held[rid] = pieces
        # A request the step left out waits for its interval like the others (a count of
        # tokens alone has no time to wait for: then it goes now). Items with no step in
        # them (the engine loop's other messages) say nothing of who was stepped.
        left_out_now = bool(stepped) and self.interval_s is None
        for rid in [r for r, pieces in self._held.items() if r not in stepped and (
                flush_all or r in ended or left_out_now or self._due(r, pieces, now))]:
            out.append(self._publication(rid, self._held.pop(rid)))
            self._sent_at[rid] = now
        for rid in ended:
            self._sent_at.pop(rid, None)
        return out

    def _take(self, rid: str | None, taken: dict[str, list[OutputChunk]]) -> list[OutputChunk]:
        """The request's pieces so far (held, then this call's), no longer kept."""
        if rid is None:
            return []
        return self._held.pop(rid, []) + taken.pop(rid, [])

    @staticmethod
    def _singly(rid: str | None, pieces: list[OutputChunk]) -> list:
        return [Publication(rid, piece) for piece in pieces]

    @staticmethod
    def _publication(rid: str, pieces: list[OutputChunk]):
        return Publication(rid, joined(pieces))
