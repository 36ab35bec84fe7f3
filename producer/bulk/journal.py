"""An analysis job's journal: what a retry of the job needs to resume where it died.

RQ retries a job whose worker died (``Retry`` on the job, producer/bulk/queue.py); the retry
runs the job function again from the top. The journal makes that a resumption: one hash per
job beside the job itself, on RQ's Redis (``rq:conveyor:journal:{job_id}``: RQ's user owns
``rq:*``, and a producer's ACL grants no writes to hashes), holds

- ``plan``: a fingerprint of the job's arguments, so a new job under a reused id starts
  afresh instead of reading another document's results;
- ``runs``: how many times the job started, ``submitted``: requests sent over all runs;
- ``cancelled``: set by `conveyor bulk cancel` (no run goes on or starts after it);
- ``done:{work}``: the result of each finished chunk or reduce request (JSON);
- ``sent:{work}``: the request in flight for a piece of work: its id, lane entry, earlier
  ids and tries (JSON).

A request is written to ``sent:`` before its XADD is sent (and its entry id after), so every
request the fleet holds is in the journal; a result moves from ``sent:`` to ``done:`` in one
MULTI. A retry takes the results as they are and re-attaches to the requests in flight
(reads their output streams from the start): no chunk is generated twice. A record without
an entry id whose request has no output yet (its run died around the XADD) is cancelled
and sent again.

Only the newest run writes: every write checks, under WATCH, that ``runs`` is still the
number its run got from :meth:`JobJournal.begin`. An older run still going (its RQ worker
stalled long enough for the job to be called abandoned and retried) gets
:class:`Superseded` at its next write and stops, leaving its requests to the new run.

The requests stay alive between two runs because the job's watch id is derived from its id
(:func:`watch_id_for`): the retry renews the watch its first run left, before the watch's
TTL runs out; RQ's detection of the abandoned job must come sooner (docs/reliability.md,
"Bulk jobs that survive their RQ worker").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from producer.bulk import defaults

_PLAN, _RUNS, _SUBMITTED, _CANCELLED = "plan", "runs", "submitted", "cancelled"
_DONE, _SENT = "done:", "sent:"


def journal_key(job_id: str) -> str:
    """Where the journal of RQ job ``job_id`` lives, on RQ's Redis."""
    return f"rq:conveyor:journal:{job_id}"


def watch_id_for(job_id: str) -> str:
    """The watch every run of job ``job_id`` keeps: the same for a retry as for its first
    run, so the retry keeps alive the requests the first run left in flight."""
    return "bulk-" + hashlib.sha256(job_id.encode()).hexdigest()[:32]


def plan_of(**arguments: Any) -> str:
    """A fingerprint of a job's arguments (JSON values)."""
    blob = json.dumps(arguments, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class Sent:
    """A request in flight for one piece of work, as the journal keeps it."""

    request_id: str
    # The lane stream and entry id it was added as (None until the XADD's reply came).
    lane: str
    entry_id: str | None = None
    # Every id the work was sent under, this one last, and the tries so far.
    request_ids: list[str] = field(default_factory=list)
    attempts: int = 1

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> Sent:
        return cls(**json.loads(raw))


@dataclass
class Resumed:
    """What a run found in its journal when it started."""

    runs: int  # this run's number: 1 for the first
    done: dict[str, dict[str, Any]]  # work key -> result
    sent: dict[str, Sent]  # work key -> the request in flight


class Superseded(RuntimeError):
    """A newer run of the job took over its journal: this run must stop, and leave the
    requests in flight alone (the newer run follows them)."""


class Cancelled(Superseded):
    """The job was cancelled (`conveyor bulk cancel`): no run of it goes on, and none starts
    (RQ's retry of it included)."""


class JobJournal:
    """Reads and writes one job's journal; see the module docstring."""

    def __init__(self, client: redis.Redis, job_id: str,
                 ttl_s: int = defaults.JOURNAL_TTL_S) -> None:
        self.client = client  # RQ's connection (the job's)
        self.key = journal_key(job_id)
        self.ttl_s = ttl_s
        self.run = 0  # this run's number, from begin()

    def begin(self, plan: str) -> Resumed:
        """Count a run and return what earlier runs of the same plan left; a journal of
        another plan (the job id reused for other arguments) is dropped."""
        found = {_text(k): v for k, v in (self.client.hgetall(self.key) or {}).items()}
        if _CANCELLED in found:
            raise Cancelled("the job was cancelled (conveyor bulk cancel)")
        if found and _text(found.get(_PLAN, b"")) != plan:
            self.client.delete(self.key)
            found = {}
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.key, _PLAN, plan)
        pipe.hincrby(self.key, _RUNS, 1)
        pipe.expire(self.key, self.ttl_s)
        runs = self.run = int(pipe.execute()[1])
        done = {k[len(_DONE):]: json.loads(v) for k, v in found.items() if k.startswith(_DONE)}
        sent = {k[len(_SENT):]: Sent.decode(v) for k, v in found.items()
                if k.startswith(_SENT) and k[len(_SENT):] not in done}
        return Resumed(runs, done, sent)

    def sending(self, sent: Mapping[str, Sent]) -> None:
        """Record requests about to be sent (before their XADDs), and count them."""
        def write(pipe: redis.client.Pipeline) -> None:
            pipe.hset(self.key, mapping={_SENT + k: s.encode() for k, s in sent.items()})
            pipe.hincrby(self.key, _SUBMITTED, len(sent))
        self._write(write)

    def placed(self, sent: Mapping[str, Sent]) -> None:
        """Add the lane entry ids the XADDs answered to records already written."""
        if sent:
            self._write(lambda pipe: pipe.hset(
                self.key, mapping={_SENT + k: s.encode() for k, s in sent.items()}))

    def done(self, work_key: str, result: Mapping[str, Any]) -> None:
        """Keep a finished request's result, in place of its in-flight record."""
        def write(pipe: redis.client.Pipeline) -> None:
            pipe.hset(self.key, _DONE + work_key, json.dumps(result, ensure_ascii=False))
            pipe.hdel(self.key, _SENT + work_key)
        self._write(write)

    def _write(self, commands: Callable[[redis.client.Pipeline], Any]) -> None:
        """Run ``commands`` in a MULTI, only while this run is the newest (Superseded
        otherwise); the journal's TTL starts again."""
        with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self.key)
                    runs = pipe.hget(self.key, _RUNS)
                    if runs is None or int(runs) != self.run:
                        raise Superseded(f"run {self.run} of the job was superseded by run "
                                         f"{_text(runs) if runs is not None else '(none)'}")
                    pipe.multi()
                    commands(pipe)
                    pipe.expire(self.key, self.ttl_s)
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue  # the other run wrote meanwhile: look again

    def submitted(self) -> int:
        """Requests sent over every run of the job."""
        return int(self.client.hget(self.key, _SUBMITTED) or 0)

    def cancel(self) -> None:
        """Mark the job cancelled: a run going on is superseded at its next write, and a run
        yet to start (a retry) stops at its beginning."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.key, _CANCELLED, "1")
        pipe.hincrby(self.key, _RUNS, 1)
        pipe.expire(self.key, self.ttl_s)
        pipe.execute()

    def in_flight(self) -> list[str]:
        """The ids of the requests in flight (each piece of work's newest try)."""
        return [Sent.decode(raw).request_id for name, raw in self.client.hgetall(self.key).items()
                if _text(name).startswith(_SENT)]

    def finish(self) -> None:
        """The job returned its result: keep the journal only a short while (RQ stores the
        result after the function returns; a death in between reruns from the journal)."""
        self.client.expire(self.key, defaults.JOURNAL_KEEP_DONE_S)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
