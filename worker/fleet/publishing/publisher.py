"""The publisher thread: writes each step's output entries, then acknowledges finished requests.

A request entry is acknowledged only after every entry it needs is in Redis: the writes go
in one round trip, the writes of each key as one MULTI/EXEC where there are several (each
transaction touches one key, as Redis Cluster requires; an EXPIRE needs none); the
acknowledgements (one XACK a request stream) go at the head of the next tick's round trip of
writes, or alone at the end of that tick where it writes nothing (no batch came within
ACK_DELAY_S, or one with nothing to write). At a GPU's step rate a batch with a final is
nearly every batch, and a round trip of its own for the XACKs cost Redis more than the
XACKs (~20 µs of its CPU a round trip, measured: docs/redis.md); an entry acknowledged a
step later is only pending a step longer (a worker that claims it finds the final and
acknowledges it itself). A write Redis refuses (out of
memory, read-only after a failover) aborts its key's whole transaction, so no output stream
ever gets a later entry without an earlier one; nothing of a batch with a refusal is
acknowledged, and the supervisor retries what was not written after a backoff. Entry ids
derived from token indexes make a repeated XADD fail harmlessly; a final that was already
there is checked to be ours before its request is acknowledged.

A decoding request's chunk costs one command, its XADD: the stream's TTL is renewed
(to the TTL plus a slack of an eighth) only once less than the TTL plus half the slack is
left, so it outlives its last write by the TTL, and the final sets it to exactly the TTL.
A stream that Redis lost (a restart without persistence) and an XADD made again gets its
TTL back within half the slack, or with its final. On a 2-core machine
the publisher shares the cores with the engine: every command it saves is engine time.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import structlog

from producer.wire.keys import GROUP, Keys
from producer.wire.protocol import FIELD, error_final, now_ms
from producer.wire.validation import request_of
from worker.fleet.handoff.handoff import HandOnWriter
from worker.fleet.handoff.prefix_share import PrefixSharer
from worker.fleet.handoff.tier_io import TierWriter
from worker.fleet.messages import (
    Forget,
    HandOn,
    Publication,
    PublisherItem,
    Rejection,
    SharePrefix,
    Track,
)
from worker.fleet.publishing.chunk_holder import ChunkHolder
from worker.fleet.publishing.ownership import OwnedEntries
from worker.fleet.publishing.raw_pipeline import run_commands
from worker.fleet.publishing.text_stage import TextStage
from worker.fleet.supervised import SupervisedThread

log = structlog.get_logger(__name__)

# The dead-letter stream is for inspection, not an archive: about this many entries, each
# with at most this much of the reason and of the raw entry. Its worst case (entries x
# their largest size, see dead_letter_fields) stays under 64 MiB.
DEAD_LETTER_MAXLEN = 10_000
DEAD_LETTER_REASON_BYTES = 1000
DEAD_LETTER_RAW_BYTES = 4096
# Engine steps whose output may wait for the publisher; past it the engine loop stops
# stepping (Redis refusing writes must not make output pile up without limit).
MAX_BACKLOG_STEPS = 256
# Seconds the publisher waits for output before it looks at what it holds (no step came).
IDLE_S = 0.5
# Seconds the publisher waits for a batch to take owed acknowledgements along before it
# sends them alone (a wait on its queue, as IDLE_S is); the tick after a batch with finals.
ACK_DELAY_S = 0.02
# How often (in batches) the publisher forgets the TTLs of streams it no longer writes.
PRUNE_EVERY_BATCHES = 1000
# Output stream names kept, by request id, before the publisher forgets them all.
MAX_CACHED_KEYS = 4096


class WriteRefused(redis.ResponseError):
    """Redis refused a write a batch needs: nothing of the batch was acknowledged."""


def already_written(result: object) -> bool:
    """An XADD refused for an id at or below the stream's top: that index is written."""
    return isinstance(result, redis.ResponseError) and "equal or smaller" in str(result)


def dead_letter_fields(item: Rejection, worker_id: str, ts_ms: int) -> dict[str, str | bytes]:
    """The dead-letter entry of a rejection, every field bounded (ids are validated already:
    a stream key, an entry id, a request id and a worker id are short)."""
    reason = item.reason.encode()[:DEAD_LETTER_REASON_BYTES].decode(errors="ignore")
    fields: dict[str, str | bytes] = {
        "reason": reason,
        "stream": item.stream,
        "entry_id": item.entry_id,
        # The request, also where the rejection was a choice's (a dead letter is the entry's).
        "request_id": request_of(item.request_id) if item.request_id else "",
        "worker": worker_id,
        "ts_ms": str(ts_ms),
    }
    if item.raw is not None:
        fields["raw"] = item.raw[:DEAD_LETTER_RAW_BYTES]
        fields["raw_bytes"] = str(len(item.raw))  # how long the entry really was
    return fields


@dataclass
class Command:
    """One write of a batch: whose it is, what it is for, the key it touches, its words."""

    item: Publication | Rejection | None  # None: an acknowledgement (of several requests)
    kind: str  # "chunk", "final", "expire", "dead" or "ack"
    key: str
    args: tuple[Any, ...]
    # An "expire" of a growing stream: on the publisher's clock, the stream lives until then.
    lives_until: float | None = None


class Publisher(SupervisedThread):
    """Writes what the engine loop produced; the engine loop never waits on Redis.

    A batch that could not be written (Redis unreachable) is kept and written first once
    the supervisor's retry succeeds: entry ids make a repeated write harmless.
    """

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, output_ttl_s: int,
                 text: TextStage, hand_on: HandOnWriter | None = None,
                 prefixes: PrefixSharer | None = None, stream_interval: int | None = None,
                 tier_writer: TierWriter | None = None,
                 stream_interval_ms: float | None = None, **supervision: Any) -> None:
        super().__init__("publisher", worker_id=worker_id, **supervision)
        # Prefill workers: stores a handed-on request's KV and hands it on (fleet/handoff.py).
        self.hand_on = hand_on
        # Workers sharing prefixes: puts computed prompt blocks in the KV tier.
        self.prefixes = prefixes
        # Writes both off this thread (tier_io.py); None: this thread writes them itself.
        self.tier_writer = tier_writer
        self.text = text
        # Holds a decoding request's chunks until stream_interval_ms passed since its last
        # one went out (or, the older way, until they carry stream_interval tokens).
        self.holder = ChunkHolder(stream_interval, None if stream_interval_ms is None
                                  else stream_interval_ms / 1000, clock=self.clock)
        self.client = client
        self.keys = keys
        self.output_ttl_s = output_ttl_s
        # Each step's output with when (publisher's clock) the engine loop handed it over.
        self._queue: queue.Queue[tuple[float, list[PublisherItem]] | None] = queue.Queue()
        # Prepared output not yet written, when the oldest of it was handed over, and
        # whether close() asked for a last flush.
        self._owed: list[Publication | Rejection | HandOn | SharePrefix] | None = None
        self._owed_since: float | None = None
        self._closing = False
        self.owned = OwnedEntries(client, worker_id)
        # Growing output streams whose TTL this publisher set, by request id: until when
        # (publisher's clock) each surely lives. Renewed once that is due (_renewal_due).
        self._lives_until: dict[str, float] = {}
        self._output_keys: dict[str, str] = {}
        self.ttl_renew_slack_s = max(1, output_ttl_s // 8)
        # Requests forgotten in the batch being written; batches written (for pruning).
        self._forgotten: list[str] = []
        # Request entries whose finals are in Redis, by request stream, not acknowledged
        # yet; whether this tick's round trip of writes took them.
        self._acks_owed: dict[str, list[str]] = {}
        self._acks_went = False
        self._batches = 0
        self.published_entries = 0
        # Output tokens handed to this publisher, written, and dropped (output of a request
        # that already ended here, by a stop string or a cancel); output chunks written
        # (chunks per token: how far the stream interval coalesces); each write round
        # trip's seconds go to ``on_round_trip`` (the worker's histogram), when set.
        self.tokens_made = 0
        self.tokens_written = 0
        self.tokens_dropped = 0
        self.chunks_written = 0
        self.on_round_trip: Callable[[float], object] | None = None
        # Seconds from a batch handed over to its entries in Redis (its wait for this
        # thread, the text stage, the round trip; not a stream interval's hold, nor the CPU
        # engine loop's hold of a step's output until its next forward), once a batch that
        # wrote entries (not one of prefix blocks or hand-ons alone, nor chunks released by
        # time alone): what the readers' gaps jitter by beside the steps' own.
        self.on_published: Callable[[float], object] | None = None
        self.refused_writes = 0  # writes Redis refused (each batch retried until it took)
        self.dead_letters = 0

    def publish(self, items: list[PublisherItem]) -> None:
        if items:
            # Tokens made, for the lag (made but not yet in Redis): counted on the engine
            # loop's thread, read anywhere (an int under the GIL).
            self.tokens_made += sum(len(item.chunk.token_ids) for item in items
                                    if type(item) is Publication and item.chunk is not None)
            self._queue.put((self.clock.monotonic(), items))

    @property
    def lag_tokens(self) -> int:
        """Tokens the engine made that are not in Redis yet (nor dropped): queued, held by
        the stream interval, or owed to a retry."""
        return max(0, self.tokens_made - self.tokens_written - self.tokens_dropped)

    @property
    def backlogged(self) -> bool:
        """More steps wait for the publisher than MAX_BACKLOG_STEPS: stop producing."""
        return self._queue.qsize() > MAX_BACKLOG_STEPS

    def close(self, timeout: float | None = None) -> bool:
        """Write everything queued so far, then stop; False when that did not finish within
        ``timeout`` seconds (Redis unreachable): the thread is then told to stop as it is."""
        self._queue.put(None)
        if self.is_alive():
            self.join(timeout)
        if self.is_alive():
            self.stopping.set()
            return False
        return True

    def tick(self) -> None:
        # Acknowledgements owed since an earlier tick go in this one: with its writes, or
        # alone at its end (no batch within ACK_DELAY_S, or nothing of it to write).
        acks_waiting = bool(self._acks_owed)
        self._acks_went = False
        if self._owed is None:
            due = self.holder.next_due()
            wait = IDLE_S if due is None else min(IDLE_S, due)
            acks_wait = ACK_DELAY_S if acks_waiting else wait
            batch, handed_at = self._take(min(wait, acks_wait))
            ready = self._prepare(batch) if batch else []
            # Held chunks leave once their interval is over (this wait ends then), stepped
            # or not; all of them when closing, or idle (no batch) where they wait for a
            # count of tokens (a request a step leaves out then goes with that step).
            idle = batch is None and self.holder.interval_s is None and acks_wait >= wait
            self._owed = self.holder.release(ready, set(self._forgotten),
                                             flush_all=idle or self._closing) or None
            self._owed_since = handed_at if self._owed else None
            for item in self._owed or ():
                if type(item) is Publication:
                    self.text.fill(item)  # once: an owed batch is retried as it is
            self.text.end_tick()
        if self._owed:
            self._write(self._owed)
        self._owed = self._owed_since = None
        if self._acks_owed and (self._closing or acks_waiting and not self._acks_went):
            self._send_acks()  # no batch with writes came to take them
        # After the writes: a forgotten request's last chunk may be in the same batch.
        for request_id in self._forgotten:
            self._lives_until.pop(request_id, None)
        self._forgotten.clear()
        self._batches += 1
        if self._batches % PRUNE_EVERY_BATCHES == 0:
            self._prune_lives_until()
        if self._closing:
            self.stopping.set()

    def _prune_lives_until(self) -> None:
        """Drop entries that are due for renewal anyway (a missing entry means the same):
        whatever way a stream stopped being written here, its entry does not outlive it
        by more than the slack."""
        now = self.clock.monotonic()
        self._lives_until = {rid: t for rid, t in self._lives_until.items()
                             if not self._renewal_due(t, now)}

    def _renewal_due(self, lives_until: float, now: float) -> bool:
        """Less than the TTL plus half the slack left: renew with the next write. That half
        covers the time until the batch reaches Redis (a busy core, a busy Redis)."""
        return lives_until - now < self.output_ttl_s + self.ttl_renew_slack_s / 2

    def _take(self, timeout: float) -> tuple[list[PublisherItem] | None, float | None]:
        """The next queued items, coalesced (one round trip for several steps when
        behind), and when the first of them was handed over; None after ``timeout``
        seconds without any."""
        try:
            first = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None, None
        if first is None:
            self._closing = True
            return None, None
        handed_at, items = first
        batch = list(items)
        while True:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                return batch, handed_at
            if more is None:
                self._closing = True
                return batch, handed_at
            batch.extend(more[1])

    def _prepare(
        self, batch: list[PublisherItem]
    ) -> list[Publication | Rejection | HandOn | SharePrefix]:
        """Detokenize, apply stop strings, and drop output of requests already ended here
        (a request whose first token completed a stop string is not handed on: it ended)."""
        ready: list[Publication | Rejection | HandOn | SharePrefix] = []
        for item in batch:
            if type(item) is Publication:  # nearly every item: one a request and step
                if self.text.apply(item):
                    ready.append(item)
                    continue
                if item.chunk is not None:  # of a request ended here: never written
                    self.tokens_dropped += len(item.chunk.token_ids)
                if item.final is not None and item.ack is not None:
                    # The engine's final of a choice a stop string ended here: the last of
                    # its request's choices to end, whose acknowledgement is the entry's.
                    ready.append(Publication(item.request_id, ack=item.ack))
            elif isinstance(item, Track):
                self.text.track(item)
            elif isinstance(item, Forget):
                self.text.forget(item)
                self._forgotten.append(item.request_id)
            elif isinstance(item, HandOn):
                if not self.text.stopped(item.request_id):
                    ready.append(item)
            elif isinstance(item, SharePrefix):
                ready.append(item)
            elif isinstance(item, Rejection) or self.text.apply(item):
                ready.append(item)
        return ready

    def _write(self, batch: list[Publication | Rejection | HandOn | SharePrefix]) -> None:
        """Write what is not written yet (with the acknowledgements owed from before at the
        head of the round trip), then hand on and share prefixes, then owe the
        acknowledgements of what this batch finished; WriteRefused leaves it all owed."""
        tier_items: list[HandOn | SharePrefix] = []
        entries: list[Publication | Rejection] = []
        for item in batch:
            if isinstance(item, (HandOn, SharePrefix)):
                tier_items.append(item)
            else:
                entries.append(item)
        todo = [item for item in entries if not item.written]
        if todo:
            acks = self._ack_commands()
            commands: list[Command] = []
            now = self.clock.monotonic()
            for item in todo:
                if isinstance(item, Rejection):
                    self._add_rejection(commands, item)
                else:
                    self._add_publication(commands, item, now)
            outcomes: dict[int, list[tuple[Command, object]]] = {id(item): [] for item in todo}
            results = self._transact(acks + commands)
            for command, result in zip(commands, results[len(acks):], strict=True):
                outcomes[id(command.item)].append((command, result))
            refused = [r for item in todo if (r := self._settle(item, outcomes[id(item)]))]
            ack_refusal = self._acks_sent(acks, results[:len(acks)])
            if refused:
                self.refused_writes += len(refused)
                raise WriteRefused(f"{len(refused)} write(s) refused, first: {refused[0]}")
            self.published_entries += len(todo)
            self._timed_published()
            if ack_refusal is not None:
                raise ack_refusal  # the writes took; the batch is retried for the XACK alone
        for item in tier_items:  # after the first tokens are written: the decode side reads them
            if not item.written:
                self._write_tier_item(item)
        self._acknowledge(entries)

    def _timed_published(self) -> None:
        """The owed batch's entries are in Redis: its time since handed over, once (a retry
        of the batch for what came after its writes is not timed again)."""
        since, self._owed_since = self._owed_since, None
        if since is not None and self.on_published is not None:
            self.on_published(self.clock.monotonic() - since)

    def _write_tier_item(self, item: HandOn | SharePrefix) -> None:
        """To the tier writer's queue; where it is full, a hand-on goes on without its KV
        (one script on the queues' Redis) and prefix blocks are not shared."""
        if self.tier_writer is not None:
            if self.tier_writer.offer(item):
                item.written = True  # the tier writer's now: never offered twice
                return
            if isinstance(item, HandOn):
                assert self.hand_on is not None, "a hand-on without a HandOnWriter"
                self.hand_on.write(item, with_kv=False)
            item.written = True
            return
        if isinstance(item, HandOn):
            assert self.hand_on is not None, "a hand-on without a HandOnWriter"
            self.hand_on.write(item)
        elif self.prefixes is not None:
            self.prefixes.write(item)

    def _transact(self, commands: list[Command], timed: bool = True) -> list[object]:
        """Run ``commands`` as one MULTI/EXEC per key that gets several writes (a key's
        lone write as it is, atomic already, with its EXPIRE beside it), all in one round
        trip; each command's result (an exception where Redis refused it, or refused its
        whole transaction). The round trip is ``run_commands``: at a step's 64 XADDs,
        redis-py's Pipeline cost twice its CPU.

        One key per transaction: a stream never gets a later entry without an earlier one
        (a refusal aborts everything written to that key in this batch), and every atomic
        step touches a single key, as Redis Cluster requires.
        """
        by_key: dict[str, list[int]] = {}
        for i, command in enumerate(commands):
            by_key.setdefault(command.key, []).append(i)
        wire: list[tuple[Any, ...]] = []
        # Each key's commands, and whether they go as one transaction: an EXPIRE needs
        # none (beside a refused write it only renews a TTL), so only several writes do.
        groups = [(indexes, sum(commands[i].kind != "expire" for i in indexes) > 1)
                  for indexes in by_key.values()]
        for indexes, transaction in groups:
            if transaction:
                wire.append(("MULTI",))
            wire.extend(commands[i].args for i in indexes)
            if transaction:
                wire.append(("EXEC",))
        started = time.perf_counter()
        replies = iter(run_commands(self.client, wire))
        if timed and self.on_round_trip is not None:
            self.on_round_trip(time.perf_counter() - started)
        results: list[object] = [None] * len(commands)
        for indexes, transaction in groups:
            if not transaction:
                for i in indexes:
                    results[i] = next(replies)
                continue
            queued = [next(replies) for _ in range(len(indexes) + 1)]  # MULTI, then each
            done = next(replies)
            if isinstance(done, Exception) or not isinstance(done, list):
                # EXECABORT (a command refused when queued: OOM, READONLY): none applied.
                refusal = next((r for r in queued if isinstance(r, Exception)), done)
                for i in indexes:
                    results[i] = refusal
            else:
                for i, result in zip(indexes, done, strict=True):
                    results[i] = result
        return results

    def _settle(self, item: Publication | Rejection,
                results: list[tuple[Command, object]]) -> object | None:
        """Record what of ``item`` is now in Redis; the first refusal, if any."""
        refusal = None
        for command, r in results:
            kind = command.kind
            if not isinstance(r, Exception):
                if kind == "dead" and isinstance(item, Rejection):
                    item.dead_lettered = True
                    self.dead_letters += 1
                elif (kind == "expire" and command.lives_until is not None and item.request_id
                      and r == 1):  # 0: no stream yet (its XADD refused): renew next time
                    self._lives_until[item.request_id] = command.lives_until
            elif kind in ("chunk", "final") and already_written(r):
                if kind == "final" and isinstance(item, Publication):
                    item.final_existed = True
            elif refusal is None:
                refusal = r
        item.written = refusal is None
        if item.written and isinstance(item, Publication):
            if item.chunk is not None:
                self.tokens_written += len(item.chunk.token_ids)
                self.chunks_written += 1
            if item.final is not None:
                self._lives_until.pop(item.request_id, None)
        if refusal is not None:
            log.warning("redis refused a write; the batch will be retried", error=str(refusal))
        return refusal

    def _acknowledge(self, batch: list[Publication | Rejection]) -> None:
        """Owe an XACK for each finished request entry whose final is ours (one XACK a
        request stream, in a later round trip); acknowledge rejected entries now,
        owner-checked.

        A final of ours in the stream means the request is complete, whoever holds its
        entry now: a worker that claimed it before our final was written took the stream
        over first (worker/fleet/intake/resume.py), and our final was refused; one that
        claims it after finds the final and acknowledges it itself. So that XACK cannot
        drop an entry another worker is serving. A rejection has no such proof (it may have
        no final): it is acknowledged only where this worker still owns the entry."""
        finished: dict[str, list[str]] = {}
        rejected: list[tuple[str, str]] = []
        for item in batch:
            if isinstance(item, Rejection):
                rejected.append((item.stream, item.entry_id))
            elif item.ack is not None and (not item.final_existed or self._final_is_there(item)):
                finished.setdefault(item.ack[0], []).append(item.ack[1])
        for stream, ids in finished.items():
            self._acks_owed.setdefault(stream, []).extend(ids)
        if not rejected:
            return
        acked = self.owned.ack(rejected)
        for entry in set(rejected) - acked:
            log.warning("not acknowledged: the entry is no longer this worker's",
                        stream=entry[0], entry_id=entry[1])

    def _ack_commands(self) -> list[Command]:
        """The owed acknowledgements as commands of the next round trip (each its own key's
        lone write: ``_transact`` wraps no transaction around it)."""
        return [Command(None, "ack", stream, ("XACK", stream, GROUP, *ids))
                for stream, ids in self._acks_owed.items()]

    def _acks_sent(self, acks: list[Command], replies: list[object]) -> Exception | None:
        """Forget the acknowledgements Redis took; a refused one stays owed (XACK again is
        harmless) and is returned, for the caller to raise: the supervisor retries after a
        backoff."""
        refusal = None
        for command, reply in zip(acks, replies, strict=True):
            if isinstance(reply, Exception):
                refusal = refusal or reply
                continue
            owed = self._acks_owed.get(command.key)
            sent = command.args[3:]
            if owed is not None:
                del owed[:len(sent)]  # later ones were owed after this round trip began
                if not owed:
                    del self._acks_owed[command.key]
        self._acks_went = bool(acks)
        return refusal

    def _send_acks(self) -> None:
        """The owed acknowledgements in a round trip of their own (not a write batch's: not
        in the write round trips' histogram)."""
        acks = self._ack_commands()
        refusal = self._acks_sent(acks, self._transact(acks, timed=False))
        if refusal is not None:
            raise refusal

    def _final_is_there(self, item: Publication) -> bool:
        """Our final's XADD met an equal or higher id: ack only if that id is our final."""
        assert item.final is not None
        eid = item.final.entry_id
        found = self.client.xrange(self.keys.output(item.request_id), eid, eid)
        if not found:
            log.warning("another worker wrote past this request's end; not acknowledged",
                        request_id=item.request_id)
        return bool(found)

    def _output_key(self, request_id: str) -> str:
        """A request's output stream, made (and its id validated) once, not at every step."""
        key = self._output_keys.get(request_id)
        if key is None:
            if len(self._output_keys) >= MAX_CACHED_KEYS:
                self._output_keys.clear()  # ended requests' keys; the live ones come back
            key = self._output_keys[request_id] = self.keys.output(request_id)
        return key

    def _add_publication(self, commands: list[Command], item: Publication, now: float) -> None:
        key = self._output_key(item.request_id)
        for kind, entry in (("chunk", item.chunk), ("final", item.final)):
            if entry is not None:
                commands.append(Command(item, kind, key, (
                    "XADD", key, entry.entry_id, FIELD, entry.encode())))
        if item.final is not None:  # an ended stream lives exactly the TTL past its end
            commands.append(Command(item, "expire", key, ("EXPIRE", key, self.output_ttl_s)))
        elif self._renewal_due(self._lives_until.get(item.request_id, now), now):
            ttl = self.output_ttl_s + self.ttl_renew_slack_s
            commands.append(Command(item, "expire", key, ("EXPIRE", key, ttl),
                                    lives_until=now + ttl))

    def _entry_message(self, stream: str, entry_id: str) -> bytes | None:
        """The message of a request entry refused after the intake let it go (the engine
        refused it: a prompt past the context, an id outside the vocabulary), read back for
        its dead letter: it is still pending, so still there. None where it is not."""
        try:
            entries = self.client.xrange(stream, entry_id, entry_id, count=1)
        except redis.ResponseError:  # (an id Redis cannot parse: the intake keeps its bytes)
            return None
        message = entries[0][1].get(FIELD) if entries else None
        return message if isinstance(message, bytes) else None

    def _add_rejection(self, commands: list[Command], item: Rejection) -> None:
        if not item.dead_lettered:
            if item.raw is None:
                item.raw = self._entry_message(item.stream, item.entry_id)
            fields = dead_letter_fields(item, self.worker_id, now_ms())
            commands.append(Command(item, "dead", self.keys.dead, (
                "XADD", self.keys.dead, "MAXLEN", "~", DEAD_LETTER_MAXLEN, "*",
                *(part for pair in fields.items() for part in pair))))
        if item.request_id and item.write_final:
            key = self.keys.output(item.request_id)
            final = error_final(item.reason, item.num_tokens, item.id_base)
            commands.append(Command(item, "final", key, (
                "XADD", key, final.entry_id, FIELD, final.encode())))
            commands.append(Command(item, "expire", key, ("EXPIRE", key, self.output_ttl_s)))
