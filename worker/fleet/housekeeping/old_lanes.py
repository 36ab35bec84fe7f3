"""Requests left on the lane keys of the layout before the hash tags: answered, not lost.

Key layout 2 put each model's lanes under a hash tag (``conveyor:req:{small}:interactive``);
a client written against layout 1 still adds requests to ``conveyor:req:small:interactive``,
which no worker reads. Housekeeping looks at those keys of the model it serves and answers
each entry there as a malformed request is answered: an ``error`` final on the request's
output stream naming the new key, the entry in the dead-letter stream, and the entry gone
from the old key, so it is answered once. An entry without a usable request id is only
dead-lettered (docs/protocol.md, "Changelog").
"""

from __future__ import annotations

import redis
import structlog

from producer.wire.keys import LANES, Keys
from producer.wire.protocol import FIELD, GenerationRequest, ProtocolError, error_final, now_ms
from worker.fleet.publishing.publisher import (
    DEAD_LETTER_MAXLEN,
    Rejection,
    already_written,
    dead_letter_fields,
)

log = structlog.get_logger(__name__)

# Entries answered per old lane key in one housekeeping round; more wait for the next.
MAX_ENTRIES_PER_ROUND = 256


def moved_reason(keys: Keys, model: str, lane: str) -> str:
    """What a request found on an old lane key is told."""
    return (f"requests go on {keys.requests(model, lane)} since key layout 2 (the model name "
            f"is a hash tag); {keys.old_layout_requests(model, lane)} is no longer read "
            "(docs/protocol.md, Changelog)")


def _after(entry_id: str) -> str:
    """The stream id right after ``entry_id``: trimming below it removes that entry."""
    ms, seq = (int(part) for part in entry_id.split("-"))
    return f"{ms}-{seq + 1}" if seq < 2**64 - 1 else f"{ms + 1}-0"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class OldLanes:
    """Answers the entries on the old-layout lane keys of one model."""

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str,
                 output_ttl_s: int) -> None:
        self.client = client
        self.keys = keys
        self.model = model
        self.worker_id = worker_id
        self.output_ttl_s = output_ttl_s
        self.answered = 0  # entries this worker took off old lane keys
        self._unreadable: set[str] = set()  # old keys of another type, logged once

    def answer(self) -> int:
        """Answer what waits on this model's old lane keys; returns how many entries."""
        done = 0
        for lane in LANES:
            old = self.keys.old_layout_requests(self.model, lane)
            try:
                entries = self.client.xrange(old, count=MAX_ENTRIES_PER_ROUND)
            except redis.ResponseError as exc:  # WRONGTYPE: not a stream, not ours to touch
                if old not in self._unreadable:
                    self._unreadable.add(old)
                    log.warning("an old-layout lane key is not a stream; left alone", key=old,
                                error=str(exc))
                continue
            if entries:
                log.warning("requests found on an old-layout lane key: answered with an error "
                            "naming the new key", key=old, entries=len(entries),
                            new_key=self.keys.requests(self.model, lane))
                done += sum(self.answer_entry(lane, _text(eid), fields)
                            for eid, fields in entries)
        return done

    def answer_entry(self, lane: str, entry_id: str, fields: dict) -> bool:
        """Answer one entry of ``lane``'s old key; True when this worker took it off the key
        (where several workers answer the same entry at once, exactly one does)."""
        old = self.keys.old_layout_requests(self.model, lane)
        reason = moved_reason(self.keys, self.model, lane)
        raw = fields.get(FIELD)
        try:
            request_id: str | None = GenerationRequest.decode(raw).request_id
        except ProtocolError as exc:
            request_id = exc.request_id
        if request_id is not None:
            # The final first: its id is fixed, so a second worker's XADD of it fails harmlessly.
            out, final = self.keys.output(request_id), error_final(reason)
            pipe = self.client.pipeline(transaction=True)
            pipe.xadd(out, {FIELD: final.encode()}, id=final.entry_id)
            pipe.expire(out, self.output_ttl_s)
            result = pipe.execute(raise_on_error=False)[0]
            if isinstance(result, Exception) and not already_written(result):
                raise result
        # XTRIM MINID just past the entry takes it off (entries before it are gone already):
        # exactly one worker sees it removed, and that one dead-letters it. XTRIM, not XDEL,
        # because the worker's ACL already grants it (trimming served requests).
        if not self.client.xtrim(old, minid=_after(entry_id), approximate=False):
            return False
        self.answered += 1
        item = Rejection(old, entry_id, reason, request_id, raw)
        fields_out = dead_letter_fields(item, self.worker_id, now_ms())
        self.client.xadd(self.keys.dead, fields_out, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        return True
