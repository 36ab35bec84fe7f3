"""`conveyor bulk`: batch files (run by this process), document analysis jobs through RQ, job
status, an RQ worker.

No torch here; RQ always runs with its JSON serializer.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from rq.exceptions import InvalidJobOperation, NoSuchJobError

from producer.bulk import defaults
from producer.bulk.batch_file import BatchSummary, run_batch_file
from producer.bulk.journal import JobJournal
from producer.bulk.queue import (
    bulk_queue,
    enqueue_analyze,
    fetch_job,
    job_progress,
    job_status,
)
from producer.bulk.requests import RetryPolicy
from producer.client.client import Client
from producer.client.models import pick_default_model
from worker.cli.client_verbs import resolve_model, schema_format
from worker.cli.redis_verbs import add_connection_args

# Seconds between two looks at a followed job.
FOLLOW_POLL_S = 0.5
# Seconds `bulk cancel` waits for a started job's work horse to be stopped.
CANCEL_WAIT_S = 10.0
# RQ job statuses after which nothing changes any more.
FINAL_STATUSES = ("finished", "failed", "stopped", "canceled")


def add_bulk_parser(subparsers: Any) -> None:
    """Add `bulk` (submit, analyze, status, cancel, worker) to the `conveyor` command's
    subparsers."""
    bulk = subparsers.add_parser(
        "bulk", help="batch files, and long-document analysis through RQ",
        description="Bulk work over the fleet's batch lane. `bulk submit` runs a batch file in "
        "this process (no RQ: it submits the lines itself and writes results as they finish; "
        "run it again to resume). `bulk analyze` enqueues an RQ job (JSON serializer) that "
        "`conveyor bulk worker` or `rq worker --serializer rq.serializers.JSONSerializer` "
        "runs.")
    bulk.set_defaults(handler=run_bulk_cmd)
    sub = bulk.add_subparsers(dest="bulk_command", required=True, metavar="ACTION")

    p = sub.add_parser("submit", help="run a JSONL batch file (OpenAI batch format) in this "
                       "process, until every line has a result")
    p.add_argument("input", type=Path, help="input JSONL: custom_id, body with prompt and "
                   "max_tokens/sampling fields")
    p.add_argument("--output", "-o", type=Path, required=True,
                   help="results JSONL; lines already in it are skipped")
    p.add_argument("--model", metavar="NAME",
                   help="model for every line (default: each body's model, else the only "
                   "model with a live worker, else the only registered model)")
    _add_request_args(p)
    p.add_argument("--concurrency", type=int, default=defaults.CONCURRENCY, metavar="N",
                   help="requests in flight at once")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    add_connection_args(p)

    p = sub.add_parser("analyze", help="enqueue analyze_document for a file and follow it")
    p.add_argument("file", help="text file to analyse ('-' reads stdin)")
    p.add_argument("--instruction", required=True, help="what to ask about the document")
    p.add_argument("--model", metavar="NAME", help="default: the only model with a live "
                   "worker, else the only registered model")
    p.add_argument("--chunk-tokens", type=int, default=defaults.CHUNK_TOKENS, metavar="N",
                   help="document tokens per chunk")
    p.add_argument("--overlap-tokens", type=int, default=defaults.OVERLAP_TOKENS, metavar="N",
                   help="tokens each chunk shares with the one before it")
    p.add_argument("--reduce-instruction", default=None,
                   help="how to combine chunk answers (default: the built-in instruction)")
    p.add_argument("--max-tokens", type=int, default=defaults.MAX_TOKENS, metavar="N",
                   help="longest chunk answer")
    p.add_argument("--reduce-max-tokens", type=int, default=None, metavar="N",
                   help="longest reduce answer (default: --max-tokens)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="of every chunk and reduce answer (greedy by default: the same "
                   "document gives the same analysis)")
    p.add_argument("--json-schema", type=Path, metavar="PATH", default=None,
                   help="a JSON Schema file: each chunk's answer and the reduced answer are "
                   "JSON valid against it (default: free text)")
    p.add_argument("--model-wait", type=float, default=defaults.MODEL_WAIT_S, metavar="S",
                   help="seconds the job waits for the model to be registered and served "
                   "by a live worker before it fails")
    _add_request_args(p)
    p.add_argument("--queue", default=defaults.DEFAULT_QUEUE, help="RQ queue name")
    p.add_argument("--no-follow", action="store_true", help="print the job id and return")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    add_connection_args(p)

    p = sub.add_parser("status", help="show any RQ job's status and progress")
    p.add_argument("job_id", metavar="JOB", help="RQ job id")
    p.add_argument("--follow", "-f", action="store_true", help="keep showing until it ends")
    p.add_argument("--json", action="store_true", help="print status, meta and result as JSON")
    add_connection_args(p)

    p = sub.add_parser("cancel", help="stop an analysis job (or any RQ job) and cancel its "
                       "requests in flight")
    p.add_argument("job_id", metavar="JOB", help="RQ job id")
    add_connection_args(p)

    p = sub.add_parser("worker", help="run an RQ worker for bulk jobs (JSON serializer)")
    p.add_argument("--queue", action="append", default=None,
                   help=f"queue to serve, repeatable (default: {defaults.DEFAULT_QUEUE})")
    p.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    add_connection_args(p)


def run_bulk_cmd(args: argparse.Namespace) -> int:
    """Run a `conveyor bulk` action; returns the exit status."""
    handler = {"submit": _submit, "analyze": _analyze, "status": _status, "cancel": _cancel,
               "worker": _worker}[args.bulk_command]
    # Redis connection errors pass to `conveyor`'s main, which says them in one line. A
    # batch file's requests are tied to this process's life (a watch, of bulk work's TTL):
    # killed, even with SIGKILL, its requests are cancelled by the workers once the watch
    # lapses, not run for nobody.
    with Client(args.redis, args.namespace, watch=args.bulk_command == "submit",
                watch_ttl_s=defaults.WATCH_TTL_S) as client:
        return handler(client, args)


def _add_request_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-timeout", type=float, default=defaults.REQUEST_TIMEOUT_S,
                   metavar="S", help="seconds a request may take before it is retried")
    p.add_argument("--max-attempts", type=int, default=defaults.MAX_ATTEMPTS, metavar="N",
                   help="tries per request when failures are transient")
    p.add_argument("--priority", type=int, default=0, help="lower is more urgent")


# --- submit ----------------------------------------------------------------------------------


def _submit(client: Client, args: argparse.Namespace) -> int:
    if not args.input.is_file():
        raise FileNotFoundError(f"no such input file: {args.input}")
    bar = None if args.quiet else ProgressBar(sys.stderr)
    policy = RetryPolicy(args.request_timeout, args.max_attempts)
    # SIGTERM (systemd, Kubernetes, timeout(1)) stops the run as Ctrl-C does: the requests
    # in flight are cancelled, and a rerun finishes what is missing.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        summary = run_batch_file(client, args.input, args.output, model=args.model,
                                 default_model=_only_model(client), policy=policy,
                                 concurrency=args.concurrency, priority=args.priority,
                                 on_progress=bar.update if bar else None)
    except KeyboardInterrupt:
        print(f"\nstopped: the requests in flight were cancelled; run it again to finish "
              f"what is missing from {args.output}", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if bar:
        bar.finish(summary)
    print(f"{summary.succeeded} succeeded, {summary.failed} failed, {summary.skipped} skipped "
          f"(already in {args.output}), {summary.elapsed_s:.1f} s", file=sys.stderr)
    return 1 if summary.failed else 0


def _interrupt(signum: int, frame: Any) -> None:
    # (once: a second SIGTERM must not cut short the cancelling the first one began)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _only_model(client: Client) -> str | None:
    """The only model with a live worker, else the only registered one, else None."""
    return pick_default_model(client.model_states())


class ProgressBar:
    """A one-line text progress bar on a terminal; a line per tenth on anything else."""

    WIDTH = 30

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self._last_tenth = -1

    def update(self, s: BatchSummary) -> None:
        todo = max(1, s.todo)
        if self.tty:
            filled = self.WIDTH * s.done // todo
            rate = s.done / s.elapsed_s if s.elapsed_s > 0 else 0.0
            self.out.write(f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {s.done}/{s.todo} "
                           f"{s.failed} errors {rate:.1f}/s")
            self.out.flush()
        elif (tenth := 10 * s.done // todo) != self._last_tenth:
            self._last_tenth = tenth
            print(f"{s.done}/{s.todo} done, {s.failed} errors", file=self.out, flush=True)

    def finish(self, s: BatchSummary) -> None:
        if self.tty and s.todo:
            self.out.write("\n")


# --- analyze and status ----------------------------------------------------------------------


def _analyze(client: Client, args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    model = resolve_model(client, args.model)
    queue = bulk_queue(name=args.queue, connection=client.redis)
    options: dict[str, Any] = {
        "chunk_tokens": args.chunk_tokens, "overlap_tokens": args.overlap_tokens,
        "reduce_instruction": args.reduce_instruction, "max_tokens": args.max_tokens,
        "reduce_max_tokens": args.reduce_max_tokens,
        "sampling": {"temperature": args.temperature,
                     **({"response_format": schema_format(args.json_schema)}
                        if args.json_schema is not None else {})},
        "request_timeout": args.request_timeout, "max_attempts": args.max_attempts,
        "priority": args.priority, "namespace": args.namespace,
        "model_wait_timeout": args.model_wait,
    }
    job = enqueue_analyze(queue, text, args.instruction, model=model, **options)
    # (with --json, stdout holds the result's JSON alone)
    print(job.id, file=sys.stderr if args.json else sys.stdout, flush=True)
    _warn_without_workers(queue)
    if args.no_follow:
        return 0
    return _follow(client, job.id, as_json=args.json)


def _status(client: Client, args: argparse.Namespace) -> int:
    if args.follow:
        return _follow(client, args.job_id, as_json=args.json)
    if (job := _job(client, args.job_id)) is None:
        return 1
    info = job_progress(job)
    if args.json:
        print(json.dumps({**info, "result": _result_of(job)}, indent=2, default=str))
    else:
        print(describe_progress(info))
        error = info["meta"].get("error") or _exc_tail(job)
        if error:
            print(f"error: {error}")
    return 0


def _job(client: Client, job_id: str) -> Any:
    """The RQ job ``job_id``; None, said on stderr, where there is none."""
    try:
        return fetch_job(client.redis, job_id)
    except NoSuchJobError:
        print(f"no such job: {job_id}", file=sys.stderr)
        return None


def _cancel(client: Client, args: argparse.Namespace) -> int:
    """Stop a started job (its work horse killed: RQ marks it ``stopped`` and never retries
    it) or cancel a waiting one; then cancel the requests its journal holds in flight, at
    once (their watch would end them only when it lapses)."""
    from rq.command import send_stop_job_command

    if (job := _job(client, args.job_id)) is None:
        return 1
    status = job_status(job)
    if status in FINAL_STATUSES:
        print(f"job {job.id} had already ended: {status}", file=sys.stderr)
        return 0
    if status == "started":
        try:
            send_stop_job_command(client.redis, job.id)
        except InvalidJobOperation:  # (no worker named: it ended, or it is between runs)
            pass
        # (its horse sends nothing more once dead: then read what it left in flight)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while job_status(job) == "started" and time.monotonic() < deadline:
            time.sleep(FOLLOW_POLL_S)
    else:
        job.cancel()
    journal = JobJournal(client.redis, job.id)
    journal.cancel()  # (a later run of it, a retry RQ makes, stops at once)
    requests = journal.in_flight()
    kwargs = job.kwargs if isinstance(job.kwargs, dict) else {}
    # Where the job's requests are: its fleet's Redis and namespace, which may not be ours.
    url, namespace = kwargs.get("redis_url"), kwargs.get("namespace") or client.keys.ns
    with (Client(url, namespace) if url
          else Client(namespace=namespace, connection=client.redis)) as fleet:
        for request_id in requests:
            fleet.cancel(request_id)
    now = job_status(job)
    print(f"job {job.id}: {now}, {len(requests)} requests in flight cancelled", file=sys.stderr)
    if now == "started":  # (a dead worker's job, or a worker that runs jobs in its process)
        print("its worker did not stop it: it ends at its next step (a retry of it finds it "
              "cancelled)", file=sys.stderr)
        return 1
    return 0


def _follow(client: Client, job_id: str, *, as_json: bool) -> int:
    last = ""
    try:
        while True:
            try:
                job = fetch_job(client.redis, job_id)
            except NoSuchJobError:
                print(f"no such job: {job_id} (or its result expired)", file=sys.stderr)
                return 1
            info = job_progress(job)
            line = describe_progress(info)
            if line != last:
                print(line, file=sys.stderr, flush=True)
                last = line
            if info["status"] in FINAL_STATUSES:
                break
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        print(f"\njob {job_id} keeps running: `conveyor bulk status {job_id}`", file=sys.stderr)
        return 130
    if info["status"] != "finished":
        print(f"error: {info['meta'].get('error') or _exc_tail(job) or info['status']}",
              file=sys.stderr)
        return 1
    result = _result_of(job)
    if as_json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
    elif isinstance(result, dict) and "answer" in result:
        print(result["answer"])
    else:
        print(json.dumps(result, ensure_ascii=False))
    return 0


def describe_progress(info: dict[str, Any]) -> str:
    """One line: a job's status and, for analysis jobs, chunks and reduce levels done."""
    meta = info["meta"]
    parts = [f"job {info['id']}: {info['status']}"]
    if meta.get("stage") == "waiting_for_model":
        state = str(meta.get("model_state", "")).replace("_", " ")
        parts.append(f"waiting for the model ({state}, {meta.get('model_waited_s', 0):g} s "
                     f"of {meta.get('model_wait_limit_s', 0):g} s)")
    if meta.get("chunks_total") is not None:
        parts.append(f"chunks {meta.get('chunks_done', 0)}/{meta['chunks_total']}")
    if meta.get("reduce_level"):
        parts.append(f"reduce level {meta['reduce_level']} "
                     f"{meta.get('reduce_done', 0)}/{meta.get('reduce_total', 0)}")
    if meta.get("retries"):
        parts.append(f"{meta['retries']} retries")
    if (meta.get("runs") or 1) > 1:  # RQ ran it again after its worker died: it resumed
        parts.append(f"run {meta['runs']} (resumed)")
    if info.get("abandoned_s") is not None:
        # (a fixed text: a followed job's line is printed again only when it changes)
        parts.append(f"its worker died (its lease in RQ's started-job registry ran out): a "
                     f"`conveyor bulk worker` on {info.get('origin')!r} retries it (none "
                     "may be running)")
    usage = meta.get("usage") or {}
    if usage.get("total_tokens"):
        parts.append(f"{usage['total_tokens']} tokens")
    other = {k: v for k, v in meta.items() if k not in _ANALYZE_META}
    if other:
        parts.append(json.dumps(other, default=str))
    return ", ".join(parts)


_ANALYZE_META = frozenset({"stage", "chunks_total", "chunks_done", "reduce_level", "reduce_total",
                           "reduce_done", "retries", "usage", "error", "updated_at",
                           "num_tokens", "model_state", "model_waited_s",
                           "model_wait_limit_s", "runs"})


def _result_of(job: Any) -> Any:
    try:
        return job.return_value()
    except Exception:  # noqa: BLE001 - a result stored by another serializer: not ours to read
        return None


def _exc_tail(job: Any) -> str | None:
    result = job.latest_result()
    exc = getattr(result, "exc_string", None) if result is not None else None
    return exc.strip().splitlines()[-1] if exc else None


def _warn_without_workers(queue: Any) -> None:
    from rq import Worker

    if not Worker.all(queue=queue):
        print(f"no RQ worker is listening on {queue.name!r} yet: start `conveyor bulk worker` "
              f"(or `rq worker {queue.name} --serializer rq.serializers.JSONSerializer`)",
              file=sys.stderr)


# --- worker ----------------------------------------------------------------------------------


def _worker(client: Client, args: argparse.Namespace) -> int:
    from rq.serializers import JSONSerializer

    from producer.bulk.workers import BulkWorker

    names = args.queue or [defaults.DEFAULT_QUEUE]
    queues = [bulk_queue(name=name, connection=client.redis) for name in names]
    worker = BulkWorker(queues, connection=client.redis, serializer=JSONSerializer)
    worker.work(burst=args.burst)
    return 0
