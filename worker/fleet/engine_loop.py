"""The engine loop thread: admit from the inbox, apply cancellations, step, hand off output."""

from __future__ import annotations

import queue
import threading
import time

import structlog

from producer.completion import FinishReason
from producer.protocol import FinalEntry, OutputChunk
from worker.engine import Engine
from worker.fleet.inflight import InflightTable
from worker.fleet.intake import Admission
from worker.fleet.publisher import Publication, Publisher, Rejection
from worker.output_processor import StepOutput

log = structlog.get_logger(__name__)


class EngineLoop(threading.Thread):
    """Runs the engine continuously; never waits on Redis (the publisher does)."""

    def __init__(self, engine: Engine, inflight: InflightTable, inbox: queue.Queue[Admission],
                 publisher: Publisher) -> None:
        super().__init__(name="engine-loop", daemon=True)
        self.engine = engine
        self.inflight = inflight
        self.inbox = inbox
        self.publisher = publisher
        self.stopping = threading.Event()
        self._cancel_lock = threading.Lock()
        self._cancels: set[str] = set()
        self.tokens_generated = 0
        self.error: BaseException | None = None

    def cancel(self, request_id: str) -> None:
        """Ask for a request to end at the next step (called from other threads)."""
        with self._cancel_lock:
            self._cancels.add(request_id)

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self._admit(block=not self.engine.has_unfinished())
                self._apply_cancels()
                if self.engine.has_unfinished():
                    self._publish(self.engine.step())
        except BaseException as exc:  # a bug in the engine: let the process die loudly
            self.error = exc
            log.exception("engine loop crashed")
            raise

    def _admit(self, block: bool) -> None:
        try:
            first = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        pending = [first]
        while True:
            try:
                pending.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for adm in pending:
            self._add(adm)

    def _add(self, adm: Admission) -> None:
        req = adm.request
        with self._cancel_lock:
            cancelled = req.request_id in self._cancels
            self._cancels.discard(req.request_id)
        if cancelled:
            self._finish_unstarted(adm, FinalEntry(str(FinishReason.CANCELLED), 0))
            return
        try:
            self.engine.add_request(adm.prompt_token_ids, req.params, request_id=req.request_id,
                                    priority=req.priority)
        except ValueError as exc:
            self.inflight.remove(req.request_id)
            self.publisher.publish([Rejection(adm.stream, adm.entry_id, str(exc),
                                              req.request_id)])

    def _finish_unstarted(self, adm: Admission, final: FinalEntry) -> None:
        self.inflight.remove(adm.request.request_id)
        self.publisher.publish([Publication(adm.request.request_id, final=final,
                                            ack=(adm.stream, adm.entry_id))])

    def _apply_cancels(self) -> None:
        with self._cancel_lock:
            if not self._cancels:
                return
            ids, self._cancels = self._cancels, set()
        outs = [o for rid in ids if (o := self.engine.abort(rid)) is not None]
        # Ids not known here may still be in the inbox, or belong to another worker.
        with self._cancel_lock:
            self._cancels |= {rid for rid in ids if rid in self.inflight} - {o.request_id for o in outs}
        self._publish(outs)

    def _publish(self, outputs: list[StepOutput]) -> None:
        items = []
        now = time.monotonic()
        for out in outputs:
            entry = self.inflight.get(out.request_id)
            if entry is None:
                continue
            chunk = None
            if out.new_token_ids:
                chunk = OutputChunk(entry.next_index, list(out.new_token_ids), out.text_delta)
                entry.next_index += len(out.new_token_ids)
                entry.first_token = entry.first_token or now
                self.tokens_generated += len(out.new_token_ids)
            final = ack = None
            if out.finished:
                usage = out.completion.usage if out.completion else None
                final = FinalEntry(
                    str(out.finish_reason), entry.next_index,
                    {"prompt_tokens": entry.num_prompt_tokens,
                     "completion_tokens": usage.completion_tokens if usage else entry.next_index,
                     "cached_tokens": usage.cached_tokens if usage else 0},
                    # Text released without a token (held back until the end) rides on the final.
                    text="" if chunk else out.text_delta,
                )
                ack = (entry.stream, entry.entry_id)
                self.inflight.remove(out.request_id)
            items.append(Publication(out.request_id, chunk, final, ack))
        self.publisher.publish(items)
