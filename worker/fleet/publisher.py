"""The publisher thread: each step's output entries, finals and acks in one pipeline."""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any

import redis
import structlog

from producer.wire.keys import GROUP, Keys
from producer.wire.protocol import FIELD, FinalEntry, OutputChunk, error_final, now_ms
from worker.fleet.supervised import SupervisedThread
from worker.fleet.text_stage import TextStage, Track

log = structlog.get_logger(__name__)

# The dead-letter stream is for inspection, not an archive: keep about this many entries.
DEAD_LETTER_MAXLEN = 100_000


@dataclass
class Publication:
    """Output of one request in one step: a chunk, a final entry, or both."""

    request_id: str
    chunk: OutputChunk | None = None
    final: FinalEntry | None = None
    # (request stream, entry id) to acknowledge once the final entry is written.
    ack: tuple[str, str] | None = None
    # Prompt tokens served from the prefix cache so far (for a final made by a stop string).
    cached_tokens: int = 0


@dataclass
class Rejection:
    """A request entry that cannot be served: dead-lettered, answered when possible, acked."""

    stream: str
    entry_id: str
    reason: str
    request_id: str | None = None
    raw: bytes | None = None
    # False when another request with this id is live: its stream must not get our error.
    write_final: bool = True
    # Tokens already on the request's output stream (the error final goes after them).
    num_tokens: int = 0


class Publisher(SupervisedThread):
    """Writes what the engine loop produced; the engine loop never waits on Redis.

    A batch that could not be written (Redis unreachable) is kept and written first once
    the supervisor's retry succeeds: entry ids make a repeated write harmless.
    """

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, output_ttl_s: int,
                 text: TextStage, **supervision: Any) -> None:
        super().__init__("publisher", worker_id=worker_id, **supervision)
        self.text = text
        self.client = client
        self.keys = keys
        self.output_ttl_s = output_ttl_s
        self._queue: queue.Queue[list[Publication | Rejection | Track] | None] = queue.Queue()
        # Prepared output not yet written, and whether close() asked for a last flush.
        self._owed: list[Publication | Rejection] | None = None
        self._closing = False
        self.published_entries = 0

    def publish(self, items: list[Publication | Rejection | Track]) -> None:
        if items:
            self._queue.put(items)

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
        if self._owed is None:
            batch = self._take()
            self._owed = self._prepare(batch) if batch else None
        if self._owed:
            self._write(self._owed)
        self._owed = None
        if self._closing:
            self.stopping.set()

    def _take(self) -> list[Publication | Rejection | Track] | None:
        """The next queued items, coalesced: one round trip for several steps when behind."""
        try:
            first = self._queue.get(timeout=0.5)
        except queue.Empty:
            return None
        if first is None:
            self._closing = True
            return None
        batch = list(first)
        while True:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                return batch
            if more is None:
                self._closing = True
                return batch
            batch.extend(more)

    def _prepare(
        self, batch: list[Publication | Rejection | Track]
    ) -> list[Publication | Rejection]:
        """Detokenize, apply stop strings, and drop output of requests already ended here."""
        ready: list[Publication | Rejection] = []
        for item in batch:
            if isinstance(item, Track):
                self.text.track(item)
            elif isinstance(item, Rejection) or self.text.apply(item):
                ready.append(item)
        return ready

    def _write(self, batch: list[Publication | Rejection]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for item in batch:
            if isinstance(item, Rejection):
                self._add_rejection(pipe, item)
            else:
                self._add_publication(pipe, item)
        results = pipe.execute(raise_on_error=False)
        self._log_failures(results)
        self.published_entries += len(batch)

    def _add_publication(self, pipe, item: Publication) -> None:
        key = self.keys.output(item.request_id)
        for entry in (item.chunk, item.final):
            if entry is not None:
                pipe.xadd(key, {FIELD: entry.encode()}, id=entry.entry_id)
        pipe.expire(key, self.output_ttl_s)
        if item.ack is not None:
            pipe.xack(item.ack[0], GROUP, item.ack[1])

    def _add_rejection(self, pipe, item: Rejection) -> None:
        fields = {
            "reason": item.reason[:2000],
            "stream": item.stream,
            "entry_id": item.entry_id,
            "request_id": item.request_id or "",
            "worker": self.worker_id,
            "ts_ms": str(now_ms()),
        }
        if item.raw is not None:
            fields["raw"] = item.raw[:65536]
        pipe.xadd(self.keys.dead, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        if item.request_id and item.write_final:
            key = self.keys.output(item.request_id)
            final = error_final(item.reason, item.num_tokens)
            pipe.xadd(key, {FIELD: final.encode()}, id=final.entry_id)
            pipe.expire(key, self.output_ttl_s)
        pipe.xack(item.stream, GROUP, item.entry_id)

    @staticmethod
    def _log_failures(results: list) -> None:
        for r in results:
            if isinstance(r, redis.ResponseError):
                # An XADD refused for an id at or below the top: a token index already written
                # (e.g. by the worker this request was claimed from). Refusing it is the point.
                if "equal or smaller" in str(r):
                    continue
                log.warning("redis refused a write", error=str(r))
