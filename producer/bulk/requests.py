"""Submit many requests to the fleet and wait for them, retrying transient failures.

A request the fleet answers with ``error`` (malformed, prompt over the model's length, a
poison request) or that someone cancelled is *invalid*: trying again cannot help. A request
that expired, that got no final entry within the request timeout (its worker died: no
worker will finish it), or whose output stream lost tokens (a gap: StreamGapError), is
*transient*: it is cancelled and submitted again under a new id after a backoff, up to a
number of tries. A model nobody registered is invalid (``code`` ``model_not_found``).
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
from producer.client.client import READ_COUNT, Client
from producer.client.stream_events import (
    OutputTracker,
    StreamEvent,
    StreamGapError,
    completion_from,
)
from producer.defaults import MAX_BLOCK_MS
from producer.wire.completion import Completion, FinishReason
from producer.wire.errors import ModelNotFound

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


class RequestRunner:
    """Keeps up to ``concurrency`` requests in flight on one lane and follows their streams
    with one XREAD; see the module docstring for what is retried."""

    def __init__(self, client: Client, *, lane: str = "batch", priority: int = 0,
                 policy: RetryPolicy | None = None,
                 concurrency: int = defaults.CONCURRENCY,
                 on_retry: Callable[[Work, str], None] | None = None) -> None:
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
        self.client = client
        self.lane = lane
        self.priority = priority
        self.policy = policy or RetryPolicy()
        self.concurrency = concurrency
        self.on_retry = on_retry
        self.retries = 0  # tries beyond the first, over all work
        self._active: dict[str, _Task] = {}  # by output stream key
        self._backlog: list[tuple[float, int, _Task]] = []  # (ready at, seq, task) heap
        self._seq = itertools.count()
        self._exhausted = False

    def run(self, works: Iterable[Work], *, fail_fast: bool = False) -> Iterator[Outcome]:
        """Yield each work's Outcome as it ends (in finishing order).

        With ``fail_fast`` the first failed Outcome raises RequestFailed instead; requests
        still in flight are cancelled whenever the iteration stops early.
        """
        source = iter(works)
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
        finally:
            self._cancel_active()
            self._backlog.clear()

    # --- submitting ------------------------------------------------------------------------

    def _fill(self, source: Iterator[Work]) -> list[Outcome]:
        ended: list[Outcome] = []
        pipe = self.client.redis.pipeline(transaction=False)
        submitted: list[_Task] = []
        now = time.monotonic()
        # Refused work counts against the window too, so a file of bad lines is not all
        # read before the first outcome is handed back.
        while len(self._active) + len(submitted) + len(ended) < self.concurrency:
            if self._backlog and self._backlog[0][0] <= now:
                task = heapq.heappop(self._backlog)[2]
            elif not self._exhausted:
                work = next(source, None)
                if work is None:
                    self._exhausted = True
                    continue
                task = _Task(work)
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
                pipe.execute()
            except _REDIS_TRANSIENT as exc:
                for task in submitted:
                    ended += self._retry_or_fail(task, f"could not submit: {exc}")
                return ended
            for task in submitted:
                self._active[self.client.keys.output(task.request_id)] = task
        return ended

    def _submit(self, task: _Task, pipe: redis.client.Pipeline) -> None:
        work = task.work
        rid = self.client.submit(work.prompt, model=work.model, messages=work.messages,
                                 lane=self.lane,
                                 priority=self.priority, timeout=self.policy.request_timeout,
                                 pipeline=pipe, **work.sampling)
        now = time.monotonic()
        task.attempts += 1
        task.request_ids.append(rid)
        task.first_submit = task.first_submit or now
        task.request_id, task.tracker, task.events = rid, OutputTracker(request_id=rid), []
        task.deadline = now + self.policy.request_timeout

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
