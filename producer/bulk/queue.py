"""RQ plumbing for bulk jobs: the queue (JSON serializer, never pickle), enqueueing an analysis
with a timeout that grows with the document, reading a job's progress, and the connection a
running job uses to reach the fleet."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote

import redis
from rq import Queue, Retry
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from producer import settings
from producer.bulk import defaults
from producer.client.connection import connect

# Where another service (or `rq enqueue`) finds the analysis job.
ANALYZE_FUNC = "producer.bulk.analyze_document"


def bulk_queue(url: str | None = None, name: str = defaults.DEFAULT_QUEUE, *,
               connection: redis.Redis | None = None) -> Queue:
    """The RQ queue for bulk jobs, with RQ's JSON serializer; ``url=None`` is the embedded
    Redis, or pass an open ``connection``."""
    return Queue(name, connection=connection or connect(url), serializer=JSONSerializer)


def job_timeout_for(text: str, model_wait_s: float = defaults.MODEL_WAIT_S) -> int:
    """Seconds an analysis of ``text`` may run: a base plus a share per 1,000 characters,
    plus the longest it may wait for its model (``model_wait_timeout``)."""
    return int(defaults.JOB_TIMEOUT_BASE_S + model_wait_s
               + defaults.JOB_TIMEOUT_PER_1K_CHARS_S * len(text) / 1000)


def enqueue_analyze(queue: Queue, text: str, instruction: str, *, model: str,
                    job_id: str | None = None, **options: Any) -> Job:
    """Enqueue :func:`producer.bulk.analyze_document` by its path, with a job timeout sized
    for the document and RQ retries (a run that dies is resumed by the next); ``options``
    are the job's other keyword arguments (JSON values)."""
    return queue.enqueue(
        ANALYZE_FUNC,
        kwargs={"text": text, "instruction": instruction, "model": model, **options},
        job_timeout=job_timeout_for(
            text, options.get("model_wait_timeout", defaults.MODEL_WAIT_S)),
        result_ttl=defaults.RESULT_TTL_S,
        failure_ttl=defaults.FAILURE_TTL_S,
        # A worker that died mid-job: run it again, at once and before queued jobs (its
        # requests live on only for its watch's TTL); it resumes from its journal.
        retry=Retry(max=defaults.JOB_RETRIES, enqueue_at_front=True),
        job_id=job_id,
        description=f"analyze {len(text)} characters with {model}: {instruction[:60]}",
        meta={"stage": "queued", "chunks_done": 0, "chunks_total": None},
    )


def fetch_job(connection: redis.Redis, job_id: str) -> Job:
    """Any RQ job by id, read with the JSON serializer; rq's NoSuchJobError when absent."""
    return Job.fetch(job_id, connection=connection, serializer=JSONSerializer)


def job_progress(job: Job, now: float | None = None) -> dict[str, Any]:
    """A job's status and the progress it keeps in its meta, as one JSON-ready dict. A
    started job's ``abandoned_s``: how long ago its run's lease in RQ's started-job
    registry ran out (its worker stopped renewing it: dead), at ``now`` (a Unix time;
    default: this host's clock); None while it holds (or where it is not started)."""
    status = job_status(job)
    return {
        "id": job.id,
        "status": status,
        "abandoned_s": _abandoned_s(job, time.time() if now is None else now)
        if status == "started" else None,
        "func": job.func_name if _readable(job) else None,
        "origin": job.origin,
        "enqueued_at": _iso(job.enqueued_at),
        "started_at": _iso(job.started_at),
        "ended_at": _iso(job.ended_at),
        "meta": dict(job.meta),
    }


def job_status(job: Job) -> str:
    """The job's status now (read again from Redis), as RQ names it."""
    job.refresh()
    status = job.get_status(refresh=False)
    return str(status.value if hasattr(status, "value") else status)


def _abandoned_s(job: Job, now: float) -> float | None:
    """Seconds since the job's newest lease in its queue's started-job registry ran out
    (RQ's own test of an abandoned job: the registry's score is when it runs out, renewed
    by each heartbeat of a forking worker); None while one holds, or where none is found."""
    registry = StartedJobRegistry(job.origin, connection=job.connection,
                                  serializer=JSONSerializer)
    prefix = f"{job.id}:".encode()
    leases = [score for member, score in job.connection.zrange(registry.key, 0, -1,
                                                                withscores=True)
              if (member if isinstance(member, bytes) else member.encode()).startswith(prefix)]
    if not leases:
        return None
    ends = max(leases)
    return round(now - ends, 1) if ends <= now else None


def fleet_url_for(connection: redis.Redis) -> str:
    """A URL for the server ``connection`` talks to (host or unix socket, db, credentials), so
    a job can open a conveyor connection (RESP2, bytes replies) next to its RQ one."""
    pool = connection.connection_pool
    kw = pool.connection_kwargs
    user, password = kw.get("username"), kw.get("password")
    db = int(kw.get("db") or 0)
    if "path" in kw:
        query = f"?db={db}" + (f"&password={quote(password, safe='')}" if password else "")
        userinfo = f"{quote(user, safe='')}@" if user else ""
        return f"unix://{userinfo}{kw['path']}{query}"
    userinfo = ""
    if user or password:
        userinfo = quote(user or "", safe="")
        userinfo += f":{quote(password, safe='')}@" if password else "@"
    scheme = "rediss" if issubclass(pool.connection_class, redis.SSLConnection) else "redis"
    return f"{scheme}://{userinfo}{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{db}"


def fleet_connection(redis_url: str | None, job: Job | None) -> redis.Redis:
    """The connection an analysis job reaches the fleet with: ``redis_url`` if given, else
    ``$CONVEYOR_REDIS_URL``, else the server the job itself came from, else the embedded one."""
    url = redis_url or settings.redis_url()
    if url is None and job is not None:
        url = fleet_url_for(job.connection)
    return connect(url)


def _readable(job: Job) -> bool:
    # A job someone else enqueued with pickle cannot be decoded here: report it anyway.
    try:
        job.func_name  # noqa: B018
    except Exception:  # noqa: BLE001 - any decoding error means "not ours to read"
        return False
    return True


def _iso(moment: Any) -> str | None:
    return moment.isoformat() if moment is not None else None
