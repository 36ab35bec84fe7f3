"""The RQ job that analyses a long document: split it by tokens, ask the fleet about every
chunk on the ``batch`` lane (map), then combine the answers (reduce), recursively when they
do not fit one context. Enqueue it by path: ``producer.bulk.analyze_document``.

Under RQ the job keeps a journal (producer/bulk/journal.py) and a watch derived from its id,
so that RQ's retry of a job whose worker died resumes it: finished chunks are kept, requests
in flight are followed again, nothing is generated twice. A failure that another run cannot
mend (a request the fleet refuses, bad options, a model nobody serves) is not retried."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any

from rq import get_current_job
from rq.job import Job
from tokenizers import Tokenizer

from producer.bulk import defaults
from producer.bulk.chunking import Span, check_chunking, item_cap, split
from producer.bulk.journal import JobJournal, Resumed, Superseded, plan_of, watch_id_for
from producer.bulk.prompts import Templates, plan_reduce
from producer.bulk.queue import fleet_connection
from producer.bulk.requests import Outcome, RequestFailed, RequestRunner, RetryPolicy, Work
from producer.client.client import Client
from producer.client.models import NOT_REGISTERED, ModelState
from producer.client.watch import check_watch_ttl
from producer.clock import SYSTEM_CLOCK, Clock
from producer.wire.errors import ModelNotFound
from producer.wire.params import SamplingParams

_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens")


class AnalysisFailed(RuntimeError):
    """A chunk or reduce request failed for good; the message carries the fleet's reason."""


@dataclass
class Analysis:
    """What one analysis asks, validated before anything is sent."""

    instruction: str
    model: str
    chunk_tokens: int
    overlap_tokens: int
    reduce_instruction: str
    map_sampling: dict[str, Any]  # SamplingParams fields of chunk requests
    reduce_sampling: dict[str, Any]  # ... and of reduce requests

    def __post_init__(self) -> None:
        check_chunking(self.chunk_tokens, self.overlap_tokens)
        SamplingParams.from_dict(self.map_sampling)
        SamplingParams.from_dict(self.reduce_sampling)


@dataclass
class Progress:
    """Progress kept in the running job's meta (only here outside RQ), saved on every change."""

    job: Job | None
    meta: dict[str, Any] = field(default_factory=lambda: {
        "stage": "starting", "chunks_total": None, "chunks_done": 0, "reduce_level": 0,
        "reduce_total": 0, "reduce_done": 0, "retries": 0, "usage": empty_usage(),
        "error": None})

    def update(self, **changes: Any) -> None:
        self.meta.update(changes, updated_at=datetime.now(UTC).isoformat())
        if self.job is not None:
            self.job.meta.update(self.meta)
            self.job.save_meta()

    def request_done(self, usage: dict[str, int], **changes: Any) -> None:
        """Count one finished request's usage into the totals, with other changes."""
        self._count([usage], **changes)

    def retried(self, *_: object) -> None:
        self.update(retries=self.meta["retries"] + 1)

    def reused(self, results: list[dict[str, Any]], **changes: Any) -> None:
        """Count results an earlier run of the job left in its journal."""
        self._count([r["usage"] for r in results], **changes)

    def _count(self, usages: list[dict[str, int]], **changes: Any) -> None:
        total = dict(self.meta["usage"])
        for usage in usages:
            for name in _USAGE_FIELDS:
                total[name] += usage[name]
        total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
        total["requests"] += len(usages)
        self.update(usage=total, **changes)

def empty_usage() -> dict[str, int]:
    return {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
            "total_tokens": 0, "requests": 0}


@dataclass(frozen=True)
class AnalyzeOptions:
    """Every option of an analysis job but the document and the question; plain JSON
    values, as RQ's JSON serializer carries a job's keyword arguments."""

    # The served model name to ask.
    model: str
    # Tokens per chunk, and how many of the previous chunk's last tokens each repeats.
    chunk_tokens: int = defaults.CHUNK_TOKENS
    overlap_tokens: int = defaults.OVERLAP_TOKENS
    # The instruction of reduce requests (None: defaults.REDUCE_INSTRUCTION).
    reduce_instruction: str | None = None
    # Answer length of chunk requests, and of reduce requests (None: max_tokens).
    max_tokens: int = defaults.MAX_TOKENS
    reduce_max_tokens: int | None = None
    # Other SamplingParams fields for every request (greedy unless it sets temperature).
    sampling: dict[str, Any] | None = None
    # Seconds a request may go without a final before it is retried under a new id.
    request_timeout: float = defaults.REQUEST_TIMEOUT_S
    # Tries per request, and the first backoff between them (seconds).
    max_attempts: int = defaults.MAX_ATTEMPTS
    backoff_base: float = defaults.BACKOFF_BASE_S
    # Requests in flight at once.
    concurrency: int = defaults.CONCURRENCY
    # Priority of every request on the batch lane.
    priority: int = 0
    # The fleet's key namespace.
    namespace: str = "conveyor"
    # The fleet's Redis (None: $CONVEYOR_REDIS_URL, else the Redis the job came from).
    redis_url: str | None = None
    # Seconds to wait for the model to be registered and served before failing.
    model_wait_timeout: float = defaults.MODEL_WAIT_S
    # Seconds the job's requests outlive the job's last sign of life (its watch's TTL):
    # longer than RQ takes to find a dead worker's job and retry it (docs/reliability.md).
    watch_ttl: int = defaults.WATCH_TTL_S

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> AnalyzeOptions:
        """Build from a job's keyword arguments, rejecting unknown ones with a ValueError."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown analysis option(s): {', '.join(map(str, unknown))}")
        if "model" not in values:
            raise ValueError("an analysis needs a model")
        return cls(**values)


def analyze_document(
    text: str,
    instruction: str,
    options: AnalyzeOptions | Mapping[str, Any] | None = None,
    *,
    clock: Clock | None = None,
    **option_fields: Any,
) -> dict[str, Any]:
    """Answer ``instruction`` about ``text`` and return a JSON-ready dict.

    ``options`` (AnalyzeOptions, or a dict of its fields) and ``option_fields`` (the same
    fields as keyword arguments: how RQ passes a job enqueued with flat kwargs, as
    ``enqueue_analyze`` and ``rq enqueue`` do) say how; ``model`` is required.

    The document is tokenized with the model's registered tokenizer and cut into chunks of
    ``chunk_tokens`` that repeat the last ``overlap_tokens`` of the previous chunk; each
    chunk goes to the fleet as token ids on the ``batch`` lane (answers of at most
    ``max_tokens``). The answers are combined by reduce requests (``reduce_instruction``,
    ``reduce_max_tokens``, default ``max_tokens``), in several levels when they do not fit
    the model's context. ``sampling`` holds other SamplingParams fields for every request
    (greedy unless it sets ``temperature``). A request is retried, under a new id, when it
    gets no final entry within ``request_timeout`` seconds (up to ``max_attempts`` tries with
    backoff from ``backoff_base``); a request the fleet refuses fails the job at once.

    Before anything is sent the job waits, up to ``model_wait_timeout`` seconds (of
    ``clock``, default the system's), for ``model`` to be registered and served by a live
    worker; meanwhile its meta says ``stage: waiting_for_model`` with ``model_state``
    (``not_registered`` or ``no_live_worker``) and ``model_waited_s``. Past that the job
    fails: ModelNotFound for a model nobody registered, AnalysisFailed for one no live
    worker serves.

    The result: ``answer``, ``chunks`` (per chunk: span, text, usage, tries), ``reduce``
    (levels and per-request results), ``usage`` totals and ``timings``. Progress (chunks
    done of total, reduce level, usage so far) is kept in the job's meta while it runs.
    Reach the fleet through ``redis_url``, else ``$CONVEYOR_REDIS_URL``, else the Redis the
    job came from.
    """
    try:
        if not isinstance(options, AnalyzeOptions):
            options = AnalyzeOptions.from_dict({**(options or {}), **option_fields})
        elif option_fields:
            options = replace(options, **option_fields)
        return _analyze(text, instruction, options, clock or SYSTEM_CLOCK)
    except (AnalysisFailed, ModelNotFound, ValueError, TypeError, Superseded):
        # The job's answer: another run would fail the same way (or, superseded, a newer
        # run carries on), so RQ must not retry it. RQ reads ``retries_left`` of this very
        # object when the job raises.
        job = get_current_job()
        if job is not None:
            job.retries_left = 0
        raise


def _analyze(text: str, instruction: str, options: AnalyzeOptions,
             clock: Clock) -> dict[str, Any]:
    o = options
    model, chunk_tokens, overlap_tokens, max_tokens = (o.model, o.chunk_tokens,
                                                       o.overlap_tokens, o.max_tokens)
    model_wait_timeout, backoff_base = o.model_wait_timeout, o.backoff_base
    marks = {"started": time.monotonic()}
    started_at = datetime.now(UTC).isoformat()
    base = {"temperature": 0.0, **(o.sampling or {})}
    reduce_max = max_tokens if o.reduce_max_tokens is None else o.reduce_max_tokens
    spec = Analysis(instruction, model, chunk_tokens, overlap_tokens,
                    o.reduce_instruction or defaults.REDUCE_INSTRUCTION,
                    {**base, "max_tokens": max_tokens}, {**base, "max_tokens": reduce_max})
    policy = RetryPolicy(o.request_timeout, o.max_attempts, backoff_base,
                         max(backoff_base, defaults.BACKOFF_CAP_S))
    check_wait(model_wait_timeout)
    check_watch_ttl(o.watch_ttl)
    job = get_current_job()
    progress = Progress(job)
    # Every run of one RQ job keeps the same watch: a retry keeps its first run's
    # requests alive by renewing it.
    watch_id = watch_id_for(job.id) if job is not None else None
    with (fleet_connection(o.redis_url, job) as connection,
          Client(namespace=o.namespace, connection=connection, watch=True,
                 watch_ttl_s=o.watch_ttl, watch_id=watch_id) as client):
        journal = JobJournal(job.connection, job.id) if job is not None else None
        runner = RequestRunner(client, lane="batch", priority=o.priority, policy=policy,
                               concurrency=o.concurrency, on_retry=progress.retried,
                               journal=journal)
        try:
            client.start_watch()  # at once: a retry may find requests whose watch lapses
            wait_for_model(client, model, model_wait_timeout, progress, clock=clock)
            marks["model_ready"] = time.monotonic()
            tokenizer, info = _model_tokenizer(client, model)
            doc_ids = tokenizer.encode(text, add_special_tokens=False).ids
            if not doc_ids or not text.strip():
                raise ValueError("the document is empty: it encodes to no tokens, or only "
                                 "blank ones")
            spans = split(len(doc_ids), chunk_tokens, overlap_tokens)
            marks["tokenized"] = time.monotonic()
            templates = Templates(tokenizer, instruction, spec.reduce_instruction)
            context = int(info["max_model_len"]) - reduce_max
            _check_reduce_room(templates, context, len(spans), max_tokens, reduce_max)
            # The plan: everything the chunks and the reduce groups follow from.
            plan = plan_of(text=text, instruction=instruction, options=asdict(o),
                           tokenizer=info["tokenizer_json"],
                           max_model_len=info["max_model_len"])
            resumed = (journal.begin(plan)
                       if journal is not None else Resumed(1, {}, {}))
            progress.update(stage="map", chunks_total=len(spans), num_tokens=len(doc_ids),
                            runs=resumed.runs)
            chunks = _map(runner, templates, spec, doc_ids, spans, progress, resumed)
            marks["mapped"] = time.monotonic()
            eos = set(info.get("eos_token_ids") or [])
            answers = [([t for t in c.pop("token_ids") if t not in eos], c["text"])
                       for c in chunks]
            answer, reduces = _reduce(runner, templates, spec, answers, context, progress,
                                      resumed)
            structured = spec.map_sampling.get("response_format") is not None
        except RequestFailed as exc:
            progress.update(stage="failed", error=_failure_message(exc.outcome))
            raise AnalysisFailed(progress.meta["error"]) from None
        except Superseded:
            raise  # the job's meta is the newer run's now
        except Exception as exc:  # Redis unreachable, a job timeout: a retry resumes
            progress.update(stage="failed", error=str(exc))
            raise
        sent = journal.submitted() if journal is not None else runner.submitted
        if journal is not None:
            journal.finish()
    marks["ended"] = time.monotonic()
    progress.update(stage="done")
    if structured:  # each result parsed (the grammar held it to the schema)
        for result in (*chunks, *reduces):
            result["json"] = parsed_json(result)
    return {
        "answer": answer, "model": model, "instruction": instruction,
        **({"answer_json": parsed_json({"text": answer, "finish_reason": "stop"})}
           if structured else {}),
        "num_tokens": len(doc_ids), "chunk_tokens": chunk_tokens,
        "overlap_tokens": overlap_tokens, "num_chunks": len(spans), "chunks": chunks,
        "reduce": {"levels": max((r["level"] for r in reduces), default=0), "requests": reduces},
        "usage": progress.meta["usage"], "retries": runner.retries,
        "runs": {"count": resumed.runs, "results_reused": len(resumed.done),
                 "requests_reattached": runner.reattached, "requests_lost": runner.lost,
                 "requests_sent": sent},
        "timings": _timings(marks, started_at),
    }


def parsed_json(result: Mapping[str, Any]) -> Any:
    """A structured result's value: its text parsed, or None where it was cut short
    (``length``: the grammar's JSON not closed) or does not parse."""
    if result.get("finish_reason") != "stop":
        return None
    try:
        return json.loads(result["text"])
    except ValueError:
        return None


def check_wait(seconds: object) -> float:
    """A model wait in seconds: a finite number >= 0, else ValueError."""
    if (not isinstance(seconds, int | float) or isinstance(seconds, bool)
            or not math.isfinite(seconds) or seconds < 0):
        raise ValueError(f"model_wait_timeout must be a number of seconds >= 0, got {seconds!r}")
    return float(seconds)


def wait_for_model(client: Client, model: str, timeout: float, progress: Progress, *,
                   clock: Clock = SYSTEM_CLOCK,
                   poll_s: float = defaults.MODEL_POLL_S) -> ModelState:
    """Return once ``model`` is registered and a live worker serves it; look every
    ``poll_s`` seconds of ``clock``, at most ``timeout`` seconds, and keep the wait in the
    job's meta. Past the timeout: ModelNotFound (never registered) or AnalysisFailed
    (registered, no live worker)."""
    started = clock.monotonic()
    never = threading.Event()  # nothing sets it: each wait lasts its whole timeout
    while True:
        state = client.model_state(model)
        waited = clock.monotonic() - started
        if state.registered and state.live:
            if waited > 0:
                progress.update(model_state=state.state, model_waited_s=round(waited, 1))
            return state
        if waited >= timeout:
            break
        # (live but not registered, as after a Redis restart until its worker's next beat,
        # is waited for as not registered: never "live" while waiting)
        progress.update(stage="waiting_for_model",
                        model_state=state.state if state.registered else NOT_REGISTERED,
                        model_waited_s=round(waited, 1), model_wait_limit_s=timeout)
        clock.wait(never, min(poll_s, timeout - waited))
    if not state.registered:
        raise ModelNotFound(model, client.models(), client.keys.ns,
                            detail=f"after waiting {timeout:g} s")
    raise AnalysisFailed(f"model {model!r} is registered but no live worker served it "
                         f"within {timeout:g} s: start a worker for it")


def _check_reduce_room(templates: Templates, context: int, chunks: int, max_tokens: int,
                       reduce_max: int) -> None:
    """ValueError, before anything is sent, where a reduce prompt (the model's length less
    ``reduce_max``) leaves each of two answers fewer than MIN_REDUCE_ANSWER_TOKENS (and
    fewer than ``max_tokens``): every answer would be cut to a fragment, and fragments
    reduced level after level. (Room for less than ``max_tokens`` but more than that cuts
    only the answers that run long, as documented.)"""
    if chunks < 2:
        return  # (one chunk: no reduce)
    room = item_cap(templates.reduce_budget(context)) - templates.label_tokens(chunks)
    if room < min(max_tokens, defaults.MIN_REDUCE_ANSWER_TOKENS):
        raise ValueError(
            f"reduce_max_tokens {reduce_max} leaves a reduce prompt of {context} tokens, room "
            f"for two answers of {max(room, 0)} tokens each: chunk answers of up to max_tokens "
            f"{max_tokens} would be cut to fragments; lower reduce_max_tokens or max_tokens")


def _model_tokenizer(client: Client, model: str) -> tuple[Tokenizer, dict[str, Any]]:
    info = client.model_info(model)
    if info is None:
        raise ValueError(f"model {model!r} is not registered: no worker has served it yet")
    if not info.get("tokenizer_json"):
        raise ValueError(f"model {model!r} was registered without a tokenizer")
    tokenizer = Tokenizer.from_str(info["tokenizer_json"])
    tokenizer.no_truncation()  # the whole document, however long
    return tokenizer, info


def _map(runner: RequestRunner, templates: Templates, spec: Analysis, doc_ids: list[int],
         spans: list[Span], progress: Progress, resumed: Resumed) -> list[dict[str, Any]]:
    """One request per chunk (none for a chunk an earlier run finished); the results in
    chunk order, token ids included."""
    results = {s.index: resumed.done[_chunk_key(s.index)] for s in spans
               if _chunk_key(s.index) in resumed.done}
    if results:
        progress.reused(list(results.values()), chunks_done=len(results))
    works = [Work(_chunk_key(s.index),
                  templates.chunk_prompt(doc_ids[s.start:s.end], s.index, len(spans)),
                  spec.model, spec.map_sampling) for s in spans if s.index not in results]
    for outcome in runner.run(works, fail_fast=True, attach=resumed.sent):
        span = spans[int(outcome.key[1:])]
        result = {"index": span.index, "start": span.start, "end": span.end,
                  **_request_result(outcome)}
        _keep(runner, outcome.key, result)
        results[span.index] = result
        progress.request_done(result["usage"], chunks_done=len(results))
    return [results[i] for i in range(len(spans))]


def _chunk_key(index: int) -> str:
    return f"c{index}"


def _reduce_key(level: int, group: int) -> str:
    return f"r{level}.{group}"


def _keep(runner: RequestRunner, key: str, result: dict[str, Any]) -> None:
    """Journal a finished request's result, so that a retry of the job reuses it."""
    if runner.journal is not None:
        runner.journal.done(key, result)


def _reduce(runner: RequestRunner, templates: Templates, spec: Analysis,
            answers: list[tuple[list[int], str]], context: int, progress: Progress,
            resumed: Resumed) -> tuple[str, list[dict[str, Any]]]:
    """Combine answers level by level until one is left; returns it and every reduce result.
    The plan follows from the answers alone, so a retry's groups are its first run's: a
    group an earlier run reduced is taken from the journal."""
    results: list[dict[str, Any]] = []
    level = 0
    while len(answers) > 1:
        level += 1
        items, groups = plan_reduce(templates, [ids for ids, _ in answers], context)
        # A group of one goes on to the next level unchanged.
        combined = {g: answers[group[0]] for g, group in enumerate(groups) if len(group) == 1}
        reduced = [g for g, group in enumerate(groups) if len(group) > 1]
        kept = [dict(resumed.done[_reduce_key(level, g)]) for g in reduced
                if resumed.done.get(_reduce_key(level, g), {}).get("inputs") == groups[g]]
        for result in kept:
            combined[result["group"]] = (result.pop("token_ids"), result["text"])
            results.append(result)
        works = [Work(_reduce_key(level, g),
                      templates.reduce_prompt(items[i] for i in groups[g]), spec.model,
                      spec.reduce_sampling) for g in reduced if g not in combined]
        progress.update(stage="reduce", reduce_level=level, reduce_total=len(reduced),
                        reduce_done=len(kept))
        if kept:
            progress.reused(kept)
        for outcome in runner.run(works, fail_fast=True, attach=resumed.sent):
            g = int(outcome.key.partition(".")[2])
            result = {"level": level, "group": g, "inputs": groups[g], **_request_result(outcome)}
            _keep(runner, outcome.key, result)
            combined[g] = (result.pop("token_ids"), result["text"])
            results.append(result)
            progress.request_done(result["usage"], reduce_done=progress.meta["reduce_done"] + 1)
        answers = [combined[g] for g in range(len(groups))]
    return answers[0][1], sorted(results, key=lambda r: (r["level"], r["group"]))


def _request_result(outcome: Outcome) -> dict[str, Any]:
    c = outcome.completion
    return {
        "text": c.text,
        "token_ids": list(c.token_ids),
        "finish_reason": str(c.finish_reason),
        "usage": {name: int(getattr(c.usage, name)) for name in _USAGE_FIELDS},
        "attempts": outcome.attempts,
        "request_ids": outcome.request_ids,
        "elapsed_s": round(outcome.elapsed_s, 4),
    }


def _timings(marks: dict[str, float], started_at: str) -> dict[str, Any]:
    return {
        "started_at": started_at,
        "ended_at": datetime.now(UTC).isoformat(),
        "model_wait_s": round(marks["model_ready"] - marks["started"], 4),
        "tokenize_s": round(marks["tokenized"] - marks["model_ready"], 4),
        "map_s": round(marks["mapped"] - marks["tokenized"], 4),
        "reduce_s": round(marks["ended"] - marks["mapped"], 4),
        "total_s": round(marks["ended"] - marks["started"], 4),
    }


def _failure_message(outcome: Outcome) -> str:
    key = outcome.key  # c{chunk index}, or r{level}.{group} of a reduce request
    if key.startswith("c"):
        what = f"chunk {key[1:]}"
    else:
        level, _, group = key[1:].partition(".")
        what = f"reduce level {level} group {group}"
    return f"{what} failed ({outcome.failure}): {outcome.error}"
