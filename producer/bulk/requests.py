"""Submit many requests to the fleet and wait for them, retrying transient failures.

A request the fleet answers with ``error`` (malformed, prompt over the model's length, a
poison request) or that someone cancelled is *invalid*: trying again cannot help. A request
that expired, that got no final entry within the request timeout (its worker died: no
worker will finish it), or whose output stream lost tokens (a gap: StreamGapError), is
*transient*: it is cancelled and submitted again under a new id after a backoff, up to a
number of tries. A model nobody registered is invalid (``code`` ``model_not_found``).

With a journal (producer/bulk/journal.py) every submit is recorded before its XADD is
sent, and a run can re-attach to requests an earlier run left in flight: it follows their
output streams from the start instead of sending them again. A re-attached request found
held by nothing (lost meanwhile), or cancelled (its watch lapsed before the retry renewed
it), is transient: sent again under a new id; so is one whose entry id the journal never
got and that has no output yet (its run died around the XADD): cancelled, in case it was
added, and sent again. A journaled run that stops for any reason but a failed request
leaves its requests in flight to the next run (their watch ends them if none comes).
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import redis

from producer.bulk import defaults
from producer.bulk.journal import JobJournal, Sent
from producer.client.client import READ_COUNT, Client
from producer.client.orphans import held_from, queue_look
from producer.client.stream_events import (
    OutputTracker,
    StreamEvent,
    StreamGapError,
    completion_from,
)
from producer.defaults import MAX_BLOCK_MS
from producer.wire.completion import Completion, FinishReason
from producer.wire.errors import ModelNotFound
from producer.wire.keys import GROUP

# Redis errors that outlived the connection's own retries: worth another try a bit later.
_REDIS_TRANSIENT = (redis.ConnectionError, redis.TimeoutError)


class FailureKind(StrEnum):
    """Whether a failed request is worth trying again."""

    INVALID = "invalid"  # the fleet refused it, or it was cancelled: never retried
    TRANSIENT = "transient"  # lost, expired or timed out: retried with backoff


def classify(completion: Completion) -> FailureKind | None:
    """None for a served request, else what kind of failure its final entry reports."""
    if completion.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        return None
    if completion.finish_reason == FinishReason.EXPIRED:
        return FailureKind.TRANSIENT
    return FailureKind.INVALID


@dataclass(frozen=True)
class RetryPolicy:
    """How long one try may take, how many tries a request gets, and the backoff between."""

    # Seconds from submission (queue wait included) to the final entry before the try is
    # presumed lost; it is also sent as the request's deadline so workers can skip it.
    request_timeout: float = defaults.REQUEST_TIMEOUT_S
    max_attempts: int = defaults.MAX_ATTEMPTS
    backoff_base: float = defaults.BACKOFF_BASE_S
    backoff_cap: float = defaults.BACKOFF_CAP_S

    def __post_init__(self) -> None:
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 s, got {self.request_timeout!r}")
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        if not 0 <= self.backoff_base <= self.backoff_cap:
            raise ValueError("backoff must satisfy 0 <= backoff_base <= backoff_cap")

    def backoff(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failed tries: jittered so retries spread out."""
        full = min(self.backoff_cap, self.backoff_base * 2 ** max(0, failures - 1))
        return full * (0.5 + 0.5 * random.random())


@dataclass
class Work:
    """One request to get done: the caller's ``key`` comes back on its Outcome."""

    key: Any
    prompt: str | list[int] | None
    model: str
    sampling: dict[str, Any]
    # Chat turns instead of a prompt (rendered by the model's chat template).
    messages: list[dict[str, str]] | None = None


@dataclass
class Outcome:
    """How one piece of work ended: a completion, or an error and its kind."""

    key: Any
    completion: Completion | None
    error: str | None = None
    failure: FailureKind | None = None
    request_ids: list[str] = field(default_factory=list)
    attempts: int = 0
    elapsed_s: float = 0.0
    # A specific error code for the caller (``model_not_found``), when there is one.
    code: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


class RequestFailed(RuntimeError):
    """A piece of work failed for good (invalid, or out of tries); the job stops there."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(f"request for {outcome.key!r} failed ({outcome.failure}): "
                         f"{outcome.error}")
        self.outcome = outcome


@dataclass
class _Task:
    work: Work
    attempts: int = 0
    request_ids: list[str] = field(default_factory=list)
    first_submit: float | None = None
    # The try in flight: its id, tracker, events so far and monotonic deadline.
    request_id: str | None = None
    tracker: OutputTracker | None = None
    events: list[StreamEvent] = field(default_factory=list)
    deadline: float = 0.0
    # Where the submit pipeline's reply holds the XADD's entry id.
    xadd_at: int = -1
    # The try in flight as an earlier run of the job sent it and its journal recorded it
    # (re-attached to); None for a try this run sent.
    placed: Sent | None = None

    @property
    def reattached(self) -> bool:
        return self.placed is not None


class RequestRunner:
    """Keeps up to ``concurrency`` requests in flight on one lane and follows their streams
    with one XREAD; see the module docstring for what is retried."""

    def __init__(self, client: Client, *, lane: str = "batch", priority: int = 0,
                 policy: RetryPolicy | None = None,
                 concurrency: int = defaults.CONCURRENCY,
                 on_retry: Callable[[Work, str], None] | None = None,
                 journal: JobJournal | None = None) -> None:
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
        self.client = client
        self.lane = lane
        self.priority = priority
        self.policy = policy or RetryPolicy()
        self.concurrency = concurrency
        self.on_retry = on_retry
        self.retries = 0  # tries beyond the first, over all work
        # Where submits are recorded (work keys are then strings), and what was found
        # there: requests of an earlier run followed, and those found lost.
        self.journal = journal
        self.reattached = 0
        self.lost = 0
        self.submitted = 0  # requests sent by this runner
        self._attach: dict[str, Sent] = {}
        self._active: dict[str, _Task] = {}  # by output stream key
        self._backlog: list[tuple[float, int, _Task]] = []  # (ready at, seq, task) heap
        self._seq = itertools.count()
        self._exhausted = False

    def run(self, works: Iterable[Work], *, fail_fast: bool = False,
            attach: dict[str, Sent] | None = None) -> Iterator[Outcome]:
        """Yield each work's Outcome as it ends (in finishing order).

        With ``fail_fast`` the first failed Outcome raises RequestFailed instead; requests
        still in flight are cancelled whenever the iteration stops early. ``attach`` maps
        work keys to requests an earlier run sent (its journal's): those works are
        followed, not sent again.
        """
        source = iter(works)
        self._attach = dict(attach or {})
        self._exhausted = False  # a runner serves one run after another (map, reduce levels)
        try:
            while True:
                ended = self._fill(source)
                if not (self._active or self._backlog or ended or not self._exhausted):
                    return
                ended += self._wait() if self._active else self._sleep_until_backlog()
                for outcome in ended:
                    if fail_fast and not outcome.ok:
                        raise RequestFailed(outcome)
                    yield outcome
        except RequestFailed:
            self._cancel_active()  # the job fails for good: nobody will want them
            raise
        finally:
            if self.journal is None:
                self._cancel_active()
            self._active.clear()
            self._backlog.clear()

    # --- submitting ------------------------------------------------------------------------

    def _fill(self, source: Iterator[Work]) -> list[Outcome]:
        ended: list[Outcome] = []
        pipe = self.client.redis.pipeline(transaction=False)
        submitted: list[_Task] = []
        attached: list[_Task] = []
        now = time.monotonic()
        # Refused work counts against the window too, so a file of bad lines is not all
        # read before the first outcome is handed back.
        while (len(self._active) + len(submitted) + len(attached) + len(ended)
               < self.concurrency):
            if self._backlog and self._backlog[0][0] <= now:
                task = heapq.heappop(self._backlog)[2]
            elif not self._exhausted:
                work = next(source, None)
                if work is None:
                    self._exhausted = True
                    continue
                task = _Task(work)
                sent = self._attach.pop(work.key, None) if self.journal else None
                if sent is not None:
                    attached.append(self._attached(task, sent))
                    continue
            else:
                break
            try:
                self._submit(task, pipe)
            except ModelNotFound as exc:  # nobody registered the model: nothing was queued
                outcome = self._outcome(task, None, str(exc), FailureKind.INVALID)
                outcome.code = "model_not_found"
                ended.append(outcome)
                continue
            except ValueError as exc:  # invalid parameters: nothing was queued for it
                ended.append(self._outcome(task, None, str(exc), FailureKind.INVALID))
                continue
            submitted.append(task)
        if submitted:
            try:
                if self.journal is not None:
                    # Before the XADDs: the fleet never holds a request the journal
                    # does not know.
                    self.journal.sending({t.work.key: self._sent(t) for t in submitted})
                replies = pipe.execute()
            except _REDIS_TRANSIENT as exc:
                # Some XADDs may have landed before the failure: those must not also run.
                self._cancel([t.request_id for t in submitted])
                for task in submitted:
                    ended += self._retry_or_fail(task, f"could not submit: {exc}")
                submitted = []
            else:
                self._placed(submitted, replies)
        for task in submitted:
            self._active[self.client.keys.output(task.request_id)] = task
        return ended + self._follow_attached(attached)

    def _submit(self, task: _Task, pipe: redis.client.Pipeline) -> None:
        work = task.work
        rid = self.client.submit(work.prompt, model=work.model, messages=work.messages,
                                 lane=self.lane,
                                 priority=self.priority, timeout=self.policy.request_timeout,
                                 pipeline=pipe, **work.sampling)
        task.xadd_at = len(pipe) - 1  # where the XADD's reply (the entry id) will be
        self.submitted += 1
        self._following(task, rid, task.attempts + 1)
        task.request_ids.append(rid)
        task.placed = None  # this run's try now

    def _following(self, task: _Task, request_id: str, attempts: int) -> None:
        now = time.monotonic()
        task.attempts = attempts
        task.first_submit = task.first_submit or now
        task.request_id, task.events = request_id, []
        task.tracker = OutputTracker(request_id=request_id)  # from the stream's start
        task.deadline = now + self.policy.request_timeout

    def _sent(self, task: _Task, entry_id: str | None = None) -> Sent:
        # Where the client put it: the shared lane, or the affinity lane of the worker that
        # holds its prompt's prefix (a later run looks for the entry there).
        lane = (self.client.stream_of(task.request_id)
                or self.client.keys.requests(task.work.model, self.lane))
        return Sent(task.request_id, lane, entry_id, list(task.request_ids), task.attempts)

    def _placed(self, submitted: list[_Task], replies: list[Any]) -> None:
        """Add the entry ids the XADDs answered to the journal (for a later lost look)."""
        if self.journal is None:
            return
        placed = {}
        for task in submitted:
            entry = replies[task.xadd_at]
            if isinstance(entry, bytes | str):
                placed[task.work.key] = self._sent(task, _text(entry))
        try:
            self.journal.placed(placed)
        except _REDIS_TRANSIENT:
            pass  # a later run finds no entry id: it resends such a request if it has no output

    # --- re-attaching ----------------------------------------------------------------------

    def _attached(self, task: _Task, sent: Sent) -> _Task:
        """Follow a request an earlier run sent, from its output stream's start."""
        task.request_ids = list(sent.request_ids) or [sent.request_id]
        self._following(task, sent.request_id, sent.attempts)
        task.placed = sent
        self.reattached += 1
        return task

    def _follow_attached(self, tasks: list[_Task]) -> list[Outcome]:
        """Look once whether anything still holds each re-attached request (its lane
        entry, a worker's pending list, its output stream): one held by nothing was lost
        while no run followed it, and is sent again; the others are followed."""
        if not tasks:
            return []
        pipe = self.client.redis.pipeline(transaction=False)
        sizes = [queue_look(pipe, t.placed.lane, t.placed.entry_id,
                            self.client.keys.output(t.request_id)) for t in tasks]
        try:
            replies = pipe.execute(raise_on_error=False)
        except _REDIS_TRANSIENT:
            replies = None
        ended: list[Outcome] = []
        at = 0
        for task, n in zip(tasks, sizes, strict=True):
            look = None if replies is None else replies[at:at + n]
            held = None if look is None else held_from(look, task.placed.entry_id, GROUP)
            at += n
            if held is False:
                self.lost += 1
                ended += self._retry_or_fail(
                    task, f"request {task.request_id} was lost while no run of the job "
                    f"followed it")
            elif task.placed.entry_id is None and look == [0]:
                # No entry id, no output: its run died around the XADD. Cancel it in case
                # it was added (a worker then drops it) and send it again now, rather than
                # waiting a whole request timeout for a request that may not exist.
                self.lost += 1
                self._cancel([task.request_id])
                ended += self._retry_or_fail(
                    task, f"request {task.request_id} was never seen by the fleet")
            else:
                self._active[self.client.keys.output(task.request_id)] = task
        return ended

    # --- waiting ---------------------------------------------------------------------------

    def _wait(self) -> list[Outcome]:
        streams = {key: task.tracker.last_id for key, task in self._active.items()}
        try:
            reply = self.client.redis.xread(streams, count=READ_COUNT, block=self._block_ms())
        except _REDIS_TRANSIENT:
            time.sleep(min(1.0, self.policy.backoff_cap))
            reply = []
        ended: list[Outcome] = []
        for stream, entries in reply or []:
            key = stream.decode() if isinstance(stream, bytes) else stream
            task = self._active.get(key)
            for entry_id, fields in entries:
                if task is None:
                    break
                try:
                    event = task.tracker.feed(entry_id, fields)
                except StreamGapError as gap:
                    # Tokens were lost: never glue over them. Drop this try and run the
                    # work again under a new id, like a try that got no final entry.
                    del self._active[key]
                    self._cancel([task.request_id])
                    ended += self._retry_or_fail(task, str(gap))
                    break
                if event is not None:
                    task.events.append(event)
                if task.tracker.done:
                    del self._active[key]
                    ended += self._finished(task)
                    task = None
        return ended + self._expire()

    def _block_ms(self) -> int:
        wake = min(task.deadline for task in self._active.values())
        if self._backlog and len(self._active) < self.concurrency:
            wake = min(wake, self._backlog[0][0])
        left = int((wake - time.monotonic()) * 1000) + 1
        return max(1, min(MAX_BLOCK_MS, left))

    def _sleep_until_backlog(self) -> list[Outcome]:
        if self._backlog:
            time.sleep(max(0.0, self._backlog[0][0] - time.monotonic()))
        return []

    def _finished(self, task: _Task) -> list[Outcome]:
        completion = completion_from(task.request_id, task.events)
        kind = classify(completion)
        if kind is None:
            return [self._outcome(task, completion)]
        error = completion.error or f"request {completion.finish_reason}"
        if task.reattached and completion.finish_reason == FinishReason.CANCELLED:
            # Not this job's cancel: its watch lapsed while no run of the job renewed it.
            return self._retry_or_fail(task, f"{error} while no run of the job followed it")
        if kind == FailureKind.INVALID:
            return [self._outcome(task, completion, error, kind)]
        return self._retry_or_fail(task, error, completion)

    def _expire(self) -> list[Outcome]:
        now = time.monotonic()
        late = [key for key, task in self._active.items() if task.deadline <= now]
        ended: list[Outcome] = []
        for key in late:
            task = self._active.pop(key)
            self._cancel([task.request_id])  # a worker that still has it may drop it
            error = (f"no final entry within {self.policy.request_timeout:g} s "
                     f"(request {task.request_id})")
            ended += self._retry_or_fail(task, error)
        return ended

    def _retry_or_fail(self, task: _Task, error: str,
                       completion: Completion | None = None) -> list[Outcome]:
        if task.attempts >= self.policy.max_attempts:
            error = f"gave up after {task.attempts} tries: {error}"
            return [self._outcome(task, completion, error, FailureKind.TRANSIENT)]
        self.retries += 1
        if self.on_retry is not None:
            self.on_retry(task.work, error)
        ready = time.monotonic() + self.policy.backoff(task.attempts)
        heapq.heappush(self._backlog, (ready, next(self._seq), task))
        return []

    def _outcome(self, task: _Task, completion: Completion | None, error: str | None = None,
                 failure: FailureKind | None = None) -> Outcome:
        elapsed = time.monotonic() - task.first_submit if task.first_submit else 0.0
        return Outcome(task.work.key, completion, error, failure, list(task.request_ids),
                       task.attempts, elapsed)

    # --- cancelling ------------------------------------------------------------------------

    def _cancel_active(self) -> None:
        ids = [task.request_id for task in self._active.values()]
        self._active.clear()
        self._cancel(ids)

    def _cancel(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        try:
            pipe = self.client.redis.pipeline(transaction=False)
            for rid in request_ids:
                self.client.cancel(rid, pipeline=pipe)
            pipe.execute()
        except _REDIS_TRANSIENT:
            pass  # best effort: an uncancelled request only costs a worker some time


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
