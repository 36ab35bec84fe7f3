"""The engine loop thread: admit from the inbox, apply cancellations, step, hand off output."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace
from typing import Any

import structlog

from producer.wire.completion import FinishReason
from producer.wire.protocol import FIELD, FinalEntry, OutputChunk, error_final, now_ms
from producer.wire.stopping import stop_reason
from scheduler.request import RequestStatus
from worker.engine.engine import Engine
from worker.engine.output_processor import StepOutput
from worker.fleet.affinity.busy import EngineState
from worker.fleet.faults import AdmissionHook
from worker.fleet.handoff.engine_kv import (
    KVNotAdopted,
    add_with_kv,
    export_kv,
    export_prefix_blocks,
)
from worker.fleet.handoff.handoff import HandoffReader, tokens_hash
from worker.fleet.inflight import InflightRequest, InflightTable, last_choice
from worker.fleet.messages import (
    Admission,
    Forget,
    HandOn,
    Publication,
    Rejection,
    SharePrefix,
    Track,
)
from worker.fleet.metrics import WorkerMetrics
from worker.fleet.publishing.publisher import Publisher
from worker.fleet.publishing.token_hold import TokenHold
from worker.fleet.supervised import SupervisedThread
from worker.sampling.randomness import stable_seed

log = structlog.get_logger(__name__)


class EngineLoop(SupervisedThread):
    """Runs the engine continuously; never waits on Redis (the publisher does).

    It meets no transient errors: any exception is a bug, and takes the worker down.
    """

    def __init__(self, engine: Engine, inflight: InflightTable,
                 inbox: queue.Queue[list[Admission]], publisher: Publisher,
                 metrics: WorkerMetrics, worker_id: str,
                 role: str = "both", kv_events: HandoffReader | None = None,
                 share_prefixes: bool = False, on_admit: AdmissionHook | None = None,
                 hold_interval_s: float = 0.0, **supervision: Any) -> None:
        super().__init__("engine-loop", worker_id=worker_id, **supervision)
        # Tokens of requests that need no look at each one wait here for the stream interval
        # (worker/fleet/publishing/token_hold.py); 0: every step's go to the publisher.
        self.hold = TokenHold(hold_interval_s) if hold_interval_s > 0 else None
        # "prefill": hand every request on once its first token is out (fleet/handoff.py).
        self.role = role
        # Where a handed-on request's KV was adopted, or recomputed instead, is counted.
        self.kv_events = kv_events
        self.handed_on = 0
        # Put each fresh request's prompt blocks in the KV tier (fleet/prefix_share.py).
        self.share_prefixes = share_prefixes
        # Runs on every admission's prompt (test-only fault injection, worker/fleet/faults.py);
        # None unless configured, and then admission runs nothing for it.
        self.on_admit = on_admit
        # Its collaborators: the engine it steps, the requests it holds, where work comes in
        # and where outputs and measurements go.
        self.engine, self.inflight, self.inbox = engine, inflight, inbox
        self.publisher, self.metrics = publisher, metrics
        self._cancel_lock = threading.Lock()
        # Requests to end at the next step, and why (cancelled, or a stop string's stop).
        self._ends: dict[str, FinishReason] = {}
        self._drops: set[str] = set()
        # Cleared while paused: requests stay admitted and leased, but no step runs.
        self._stepping = threading.Event()
        self._stepping.set()
        self.tokens_generated = 0
        # Since when (the clock's monotonic seconds) a step has run, and the oldest request
        # still waiting for room in the batch has waited: prefix affinity's busy signal
        # (fleet/affinity/busy.py). Requests added to the engine, oldest first, with when.
        self._step_began: float | None = None
        self._waiting_since: float | None = None
        self._queued: dict[str, float] = {}
        # A step's output waits here until the next step's forward starts (CPU, one step at
        # a time): the publisher's Python then runs while the engine's native step holds no
        # GIL, not beside the loop's own Python between steps, which it would make wait for
        # the GIL with its CPU idle. Anything else this loop publishes sends it first.
        self._hold_output = engine.device.type == "cpu" and not engine.async_scheduling
        self._held: list = []
        if self._hold_output:
            engine.runner.on_forward = self._send_held

    def _send(self, items: list) -> None:
        """Hand ``items`` to the publisher, after any step output held so far (order)."""
        self._send_held()
        self.publisher.publish(items)

    def _send_held(self) -> None:
        if self._held:
            held, self._held = self._held, []
            self.publisher.publish(held)

    def stop(self, timeout: float | None = None) -> None:
        super().stop(timeout)
        if not self.is_alive():
            self._release_held_tokens()
            self._send_held()  # the last step's output, with no forward after it

    @property
    def held_tokens(self) -> int:
        """Tokens made and held here for the stream interval (part of the publisher lag)."""
        return self.hold.tokens if self.hold is not None else 0

    def _release_held_tokens(self) -> None:
        """Every token held for the stream interval, to the publisher (pausing, idle, stop)."""
        if self.hold is not None and self.hold.tokens:
            self._send(self._publications(self.hold.release_all(self.clock.monotonic())))

    def _publications(self, released: list[tuple[InflightRequest, list[int]]]) -> list:
        return [Publication(e.request_id, OutputChunk(e.next_index - len(tokens), tokens,
                                                      id_base=e.id_base), coalesced=True)
                for e, tokens in released]

    def cancel(self, request_id: str) -> None:
        """Ask for a request to end as cancelled at the next step (from other threads):
        every choice of it, where it has several."""
        # (choice 0 may have ended already: its choices are found by their ids)
        choices = [rid for rid in self.inflight.ids() if rid.startswith(request_id + ".")]
        for rid in [request_id, *choices]:
            self.end(rid, FinishReason.CANCELLED)

    def end(self, request_id: str, reason: FinishReason) -> None:
        """Ask for a request to end at the next step with ``reason`` (the first asked wins)."""
        with self._cancel_lock:
            self._ends.setdefault(request_id, reason)

    def drop(self, request_id: str) -> None:
        """Stop a request without publishing anything: another worker owns it now."""
        with self._cancel_lock:
            self._drops.add(request_id)

    def pause(self) -> None:
        """Stop stepping after the current step (backpressure); admissions go on."""
        self._stepping.clear()

    def resume(self) -> None:
        self._stepping.set()

    @property
    def paused(self) -> bool:
        return not self._stepping.is_set()

    def tick(self) -> None:
        # Backlogged: Redis refuses the publisher's writes; stepping on would only pile up
        # output in memory. Admissions and cancellations go on meanwhile.
        backlogged = self.publisher.backlogged
        hold = self.paused or backlogged
        # No forward comes soon to send held output: send it now, unless the publisher is
        # backed up (then it stays here, one step's worth, until the backlog clears).
        if not backlogged and (not self.engine.has_unfinished() or hold):
            self._release_held_tokens()
            self._send_held()
        self._admit(block=not self.engine.has_unfinished() or hold)
        self._apply_cancels()
        if not self.engine.has_unfinished() or hold:
            if not self.engine.has_unfinished():
                self._waiting_since = None  # (what waited was cancelled)
                self._queued.clear()
            if not backlogged:
                self._send_held()
        else:
            outputs = self._step()
            if self.share_prefixes:
                self._share_prefixes(outputs)
            if self.role == "prefill":
                outputs = self._hand_on(outputs)
            self._publish(outputs, stepped=True)

    def _admit(self, block: bool) -> None:
        try:
            pending = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:  # every read the intake handed over by now
            try:
                pending += self.inbox.get_nowait()
            except queue.Empty:
                break
        for adm in pending:
            self._add(adm)

    def _oldest_waiting(self) -> float | None:
        """When the oldest request still waiting for a seat in the batch was added (those
        that started or ended before it are dropped as they come to the front)."""
        requests = self.engine.scheduler.requests
        while self._queued:
            rid, added = next(iter(self._queued.items()))
            req = requests.get(rid)
            if req is not None and req.status is RequestStatus.WAITING:
                return added
            del self._queued[rid]
        return None

    def engine_state(self) -> EngineState:
        """Since when the current step has run and requests have waited (other threads)."""
        return EngineState(self._step_began, self._waiting_since)

    def _step(self) -> list[StepOutput]:
        # The runner's counter, not engine.stats(): that builds a whole dict, twice a step.
        before = self.engine.runner.num_computed_tokens
        start = time.perf_counter()
        self._step_began = self.clock.monotonic()
        outputs = self.engine.step()
        self._step_began = None
        self._waiting_since = self._oldest_waiting()
        elapsed = time.perf_counter() - start
        tokens = self.engine.runner.num_computed_tokens - before
        if tokens:  # a step that ran no forward (nothing fit) is not a step worth timing
            self.metrics.step_done(elapsed, tokens)
        else:
            self._send_held()  # and no forward ran to send the held output
        return outputs

    def _share_prefixes(self, outputs: list[StepOutput]) -> None:
        """The prompt blocks of every request whose first token this step produced, for the
        publisher to put in the tier (a copy here; the Redis writes happen there)."""
        items = []
        for out in outputs:
            entry = self.inflight.get(out.request_id)
            if out.finished or not out.new_token_ids or entry is None or entry.next_index:
                continue  # ended already, or resumed (its prompt was shared where it began)
            blocks = export_prefix_blocks(self.engine, out.request_id)
            if blocks:
                items.append(SharePrefix(out.request_id, blocks))
        self._send(items)

    def _hand_on(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """Take every request whose first token this step produced (and that goes on) out
        of the engine, its KV with it; its token is published as usual, then it is handed
        on. Returns the outputs to publish as they are."""
        keep, handed = [], []
        tokens: dict[str, list[int]] = {}
        for out in outputs:
            entry = self.inflight.get(out.request_id)
            if out.finished or not out.new_token_ids or entry is None or entry.message is None:
                keep.append(out)
                continue
            # A simulated engine has no KV: the decode side computes the prompt again.
            kv = None if self.engine.simulated else export_kv(self.engine, out.request_id)
            tokens[out.request_id] = self.engine.token_ids(out.request_id)
            self.engine.abort(out.request_id)  # its final is not ours to publish
            handed.append((out, entry, kv))
        if not handed:
            return keep
        self._publish(keep)
        items: list = []
        for out, entry, kv in handed:
            items.append(self._chunk_publication(out, entry))
            self.inflight.remove(out.request_id)
            items.append(HandOn(out.request_id, entry.stream, entry.entry_id, entry.message,
                                FIELD, kv, tokens_hash(tokens[out.request_id][
                                    :kv.num_tokens if kv is not None else None])))
            items.append(Forget(out.request_id))
        self._send(items)
        self.handed_on += len(handed)
        return []

    def _chunk_publication(self, out: StepOutput, entry: InflightRequest) -> Publication:
        chunk = OutputChunk(entry.next_index, list(out.new_token_ids),
                            logprobs=wire_logprobs(out), id_base=entry.id_base)
        if out.prompt_logprobs is not None:
            with_prompt_logprobs(chunk, out)
        entry.next_index += len(out.new_token_ids)
        self._time_tokens(entry, time.monotonic(), len(out.new_token_ids))
        self.tokens_generated += len(out.new_token_ids)
        self.metrics.tokens_generated(len(out.new_token_ids))
        return Publication(out.request_id, chunk)

    def _add(self, adm: Admission) -> None:
        req = adm.request
        # Queue wait is on the producer's clock: Redis stream, worker inbox, until now.
        wait_s = max(0.0, (now_ms() - req.created_ms) / 1000)
        with self._cancel_lock:
            ended = self._ends.pop(req.request_id, None)
        # Tokens an earlier worker published (a take-over, a handoff).
        generated = adm.published.token_ids if adm.published else []
        if (ended is None and req.deadline_ms and not generated
                and self.clock.time() * 1000 >= req.deadline_ms):
            # Past its deadline with nothing done (a resumed one may be complete already:
            # below, or the engine expires it keeping its tokens).
            ended = FinishReason.EXPIRED
        if ended is not None:
            log.info("request ended before it started", request_id=req.request_id,
                     finish_reason=str(ended))
            self.metrics.request_finished(str(ended), wait_s, 0)
            # After the tokens an earlier worker published, if it was resumed.
            self._finish_unstarted(adm, FinalEntry(str(ended), len(generated)))
            return
        entry = self.inflight.get(req.request_id)
        if entry is None:
            # Dropped while it waited (its lease went to another worker, say while its KV
            # was fetched): not this worker's to serve any more.
            log.info("request dropped before it started", request_id=req.request_id)
            return
        entry.created = time.monotonic() - wait_s
        if self.on_admit is not None:
            self.on_admit(adm.prompt_token_ids)
        if generated:  # (its first token went out from another worker: not timed again)
            entry.first_token = entry.last_token = time.monotonic()
        if generated and (reason := self._already_done(adm, generated)) is not None:
            self._finish_unstarted(adm, FinalEntry(str(reason), len(generated),
                                                   {"prompt_tokens": len(adm.prompt_token_ids),
                                                    "completion_tokens": len(generated)}))
            return
        # Unseeded requests get a seed from their id: a resumed request samples the same
        # tokens on any worker.
        params = req.params if req.params.seed is not None else replace(
            req.params, seed=stable_seed(req.request_id))
        deadline = req.deadline_ms / 1000 if req.deadline_ms else None
        try:
            self._add_to_engine(adm, params, generated, deadline)
        except ValueError as exc:
            log.warning("request rejected", request_id=req.request_id, reason=str(exc))
            self.metrics.request_finished(str(FinishReason.ERROR), wait_s, 0)
            id_base = adm.published.id_base if adm.published else 0
            if last_choice(self.inflight.remove(req.request_id)):
                # After the tokens already published: Redis refuses a final at a lower index.
                self._send([Rejection(adm.stream, adm.entry_id, str(exc),
                                      req.request_id, num_tokens=len(generated),
                                      id_base=id_base)])
            else:  # a choice of several: its entry is dead-lettered with the last of them
                self._send([Publication(req.request_id, final=error_final(
                    str(exc), len(generated), id_base))])
            return
        self._queued[req.request_id] = self.clock.monotonic()
        self._send([Track(req.request_id, req.params, len(adm.prompt_token_ids),
                          (adm.stream, adm.entry_id) if entry.choices is None else None,
                          generated, adm.published.text if adm.published else "")])
        # Held here for the stream interval unless its text is looked at token by token
        # (stop strings, log-probabilities) or it is handed on after its first token.
        entry.coalesce = (self.hold is not None and not req.params.stop
                          and req.params.logprobs is None and req.params.prompt_logprobs is None
                          and self.role != "prefill")
        self.metrics.request_admitted(req.lane, len(adm.prompt_token_ids),
                                      None if generated else wait_s)
        log.debug("request admitted", request_id=req.request_id, lane=req.lane,
                  prompt_tokens=len(adm.prompt_token_ids), queue_wait_ms=round(wait_s * 1000, 1))

    def _add_to_engine(self, adm: Admission, params, generated: list[int],
                       deadline: float | None) -> None:
        req = adm.request
        kwargs = dict(request_id=req.request_id, priority=req.priority,
                      generated_token_ids=generated, deadline=deadline)
        # Prompt logprobs are made in the prefill: such a request computes its whole prompt.
        if adm.kv is not None and (req.params.prompt_logprobs is None or generated):
            try:
                add_with_kv(self.engine, adm.prompt_token_ids, params, adm.kv, **kwargs)
            except KVNotAdopted as exc:  # no room now, or the wrong span: compute the prompt
                if adm.kv_source == "handoff" and self.kv_events is not None:
                    self.kv_events.fallback(req.request_id, exc.cause, str(exc))
            else:
                if adm.kv_source == "handoff" and self.kv_events is not None:
                    self.kv_events.adopted()
                return
        self.engine.add_request(adm.prompt_token_ids, params, **kwargs)

    def _already_done(self, adm: Admission, generated: list[int]) -> FinishReason | None:
        """A resumed request whose published tokens already end it (its worker died first);
        its token limit is the engine's rule (worker/engine/admission.py)."""
        p = adm.request.params
        limit = self.engine.checks.token_limit(len(adm.prompt_token_ids), p)
        return stop_reason(generated[-1], len(generated),
                           len(adm.prompt_token_ids) + len(generated), max_tokens=limit,
                           max_model_len=self.engine.max_model_len,
                           stop_token_ids=p.stop_token_ids,
                           eos_token_ids=self.engine.eos_token_ids, ignore_eos=p.ignore_eos,
                           min_tokens=p.min_tokens)

    def _finish_unstarted(self, adm: Admission, final: FinalEntry) -> None:
        if adm.published is not None:  # a request taken over: in its generation of ids
            final.id_base = adm.published.id_base
        last = last_choice(self.inflight.remove(adm.request.request_id))
        self._send([Publication(adm.request.request_id, final=final,
                                ack=(adm.stream, adm.entry_id) if last else None)])

    def _apply_cancels(self) -> None:
        self._apply_drops()
        with self._cancel_lock:
            if not self._ends:
                return
            ends, self._ends = self._ends, {}
        outs = [o for rid, why in ends.items() if (o := self.engine.abort(rid, why)) is not None]
        # Ids not known here may still be in the inbox, or belong to another worker.
        with self._cancel_lock:
            done = {o.request_id for o in outs}
            for rid, why in ends.items():
                if rid in self.inflight and rid not in done:
                    self._ends.setdefault(rid, why)
        self._publish(outs)

    def _apply_drops(self) -> None:
        with self._cancel_lock:
            if not self._drops:
                return
            ids, self._drops = self._drops, set()
        items: list = []
        for rid in ids:
            entry = self.inflight.remove(rid)  # first: the abort's output must find no entry
            self.engine.abort(rid)
            if entry is None:  # (dropped already: a renewal may name it again before this)
                continue
            self.metrics.leases_lost.inc()
            if entry.held:  # (only a TokenHold fills it)
                # Its tokens held so far go out (whoever took it over fenced them already).
                items += self._publications([(entry, self.hold.release(entry))])
        self._send(items + [Forget(rid) for rid in ids])

    def _publish(self, outputs: list[StepOutput], stepped: bool = False) -> None:
        """Hand each output to the publisher (``stepped``: they are a step's, and requests
        the step left out release the tokens they hold once their interval is over)."""
        items = []
        now = time.monotonic()
        at = self.clock.monotonic()  # held tokens are timed on the loop's clock
        generated = 0
        hold = self.hold
        if hold is not None and self.publisher.retrying is not None:
            # Output is not reaching Redis: nothing is held here, so that every step's output
            # counts in the publisher's backlog (MAX_BACKLOG_STEPS stops the steps, as it does
            # for requests whose tokens are never held).
            items += self._publications(hold.release_all(at))
            hold = None
        for out, entry in zip(outputs, self.inflight.get_each([o.request_id for o in outputs]),
                              strict=True):
            if entry is None:
                continue
            chunk = None
            new = out.new_token_ids
            tokens = list(new)
            if new:
                self._time_tokens(entry, now, len(new))
                generated += len(new)
                entry.next_index += len(new)
            if hold is not None and entry.coalesce and (new or out.finished):
                tokens = hold.take(entry, tokens, at, out.finished) if new else \
                    hold.release(entry)  # ended without a token: with what it held
                if tokens is None:
                    continue  # held: its chunk goes once the stream interval is over
            if tokens:
                # Text is filled in on the publisher thread (TextStage).
                chunk = OutputChunk(entry.next_index - len(tokens), tokens,
                                    logprobs=wire_logprobs(out) if out.logprobs else None,
                                    id_base=entry.id_base)
                if out.prompt_logprobs is not None:
                    with_prompt_logprobs(chunk, out)
            final = ack = None
            if out.finished:
                usage = out.completion.usage if out.completion else None
                final = FinalEntry(
                    str(out.finish_reason), entry.next_index,
                    {"prompt_tokens": entry.num_prompt_tokens,
                     "completion_tokens": usage.completion_tokens if usage else entry.next_index,
                     "cached_tokens": usage.cached_tokens if usage else 0,
                     "kv_transferred_tokens": usage.kv_transferred_tokens if usage else 0},
                    error=out.completion.error if out.completion else None,
                    id_base=entry.id_base,
                )
                # (a choice of several: the entry is done with the last of them)
                ack = (entry.stream, entry.entry_id) if last_choice(entry) else None
                self.inflight.remove(out.request_id)
                self._finished(entry, final, now)
            items.append(Publication(out.request_id, chunk, final, ack, out.num_cached_tokens,
                                     coalesced=entry.coalesce and hold is not None))
        if hold is not None and stepped:
            items += self._publications(hold.due(at))  # those the step left out
        if self._hold_output:
            self._held += items
        else:
            self._send(items)
        if generated:
            self.tokens_generated += generated
            self.metrics.tokens_generated(generated)

    def _time_tokens(self, entry: InflightRequest, now: float, num_tokens: int) -> None:
        if entry.first_token is None:
            entry.first_token = now
            self.metrics.first_token(now - (entry.created or entry.received))
        else:
            self.metrics.token_gap((now - (entry.last_token or now)) / num_tokens, num_tokens)
        entry.last_token = now

    def _finished(self, entry: InflightRequest, final: FinalEntry, now: float) -> None:
        created = entry.created or entry.received
        usage = final.usage or {}
        self.metrics.request_finished(final.finish_reason, now - created,
                                      usage.get("cached_tokens", 0))
        ttft = None if entry.first_token is None else round((entry.first_token - created) * 1000, 1)
        log.debug("request finished", request_id=entry.request_id,
                 finish_reason=final.finish_reason, prompt_tokens=entry.num_prompt_tokens,
                 completion_tokens=usage.get("completion_tokens"),
                 cached_tokens=usage.get("cached_tokens", 0), ttft_ms=ttft,
                 e2e_ms=round((now - created) * 1000, 1))


def wire_logprobs(out: StepOutput) -> list[list[Any]] | None:
    """A step's logprobs as an output chunk carries them (None: the request asked for none).
    One entry per new token: a step adds one token to a request."""
    if not out.logprobs or len(out.logprobs) != len(out.new_token_ids):
        return None
    return [[lp.logprob, [[t, a] for t, a in lp.top]] for lp in out.logprobs]


def with_prompt_logprobs(chunk: OutputChunk, out: StepOutput) -> None:
    """The request's first chunk carries its prompt's logprobs (docs/protocol.md)."""
    assert out.prompt_logprobs is not None
    chunk.prompt_token_ids = list(out.prompt_token_ids or [])
    chunk.prompt_logprobs = [None if lp is None else [lp.logprob, [[t, a] for t, a in lp.top]]
                             for lp in out.prompt_logprobs]
